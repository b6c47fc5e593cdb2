"""Budget policies: how many heads each input (or token) may use."""

from condcomp.policies import fixed, full  # noqa: F401
