"""Budget policies: how many heads each input (or token) may use."""

from condcomp.policies import budgetformer, budgetformer_cond, fixed, full, token_budget  # noqa: F401
