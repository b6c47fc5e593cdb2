"""A small class-conditional Diffusion Transformer on scikit-learn's digits, with MoH and noise-level-aware head
budgets (``condcomp dit``; docs/dit.md). Needs the ``vision`` extra (scikit-learn); plots need ``report``."""
