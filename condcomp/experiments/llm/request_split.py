"""A per-request full/window KV split's router: training and its file: moved to :mod:`condcomp.kv.request_router`
(public through :mod:`condcomp.kv.calibration`); the names are re-exported here for the studies' code."""

from __future__ import annotations

from condcomp.kv.request_router import (
    FORMAT,
    RequestSettings,
    RequestSplit,
    load_router,
    model_shape,
    routed,
    save_router,
    train_router,
)

__all__ = ["FORMAT", "RequestSettings", "RequestSplit", "load_router", "model_shape", "routed", "save_router",
           "train_router"]
