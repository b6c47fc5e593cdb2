"""Head and KV-group importance (Michel et al.'s gradient importance): moved to :mod:`condcomp.kv.importance` (public
through :mod:`condcomp.kv.calibration`); the names are re-exported here for the studies' code."""

from __future__ import annotations

from condcomp.kv.importance import (
    LossFn,
    group_heads,
    group_importance,
    head_gradients,
    head_importance,
    keep_groups,
    output_projections,
    warm_start_scores,
)

__all__ = ["LossFn", "group_heads", "group_importance", "head_gradients", "head_importance", "keep_groups",
           "output_projections", "warm_start_scores"]
