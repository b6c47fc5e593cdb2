"""The text-classification study: BudgetFormer, MoH and their controls on encoder classifiers (``condcomp demo``,
``train``, ``eval``, ``ablate``, ``report``)."""
