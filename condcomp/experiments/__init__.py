"""The studies behind the command line, one package each, and what they share.

- ``classification/``: learned budgets vs fixed top-k vs MoH on encoder classifiers (``condcomp demo``, ``train``,
  ``eval``, ``ablate``, ``report``): one run (``runner``, ``train``), one dataset and seed (``seed_study``), the
  multi-seed ablation (``ablation``, ``ablation_summary``, ``ablation_stats``), its results page (``study_page*``).
- ``llm/``: continue-tuning SmolLM2 into routed variants (``condcomp tune-llm``): ``tuning`` (the loop),
  ``tuning_study``, ``tuning_report``, ``variants``, ``evaluation``, ``smollm2`` (the model loader).
- ``dit/``: a class-conditional DiT on digits (``condcomp dit``).
- shared: ``data`` (staged datasets), ``progress`` (progress bars), ``stats`` (intervals and paired tests),
  ``digits`` (scikit-learn's digits and their split), ``plots`` (matplotlib, lazily, and saving a figure).

Import-light: tokenizers, tqdm, matplotlib, safetensors and codecarbon are imported only when used.
"""
