"""Moved to :mod:`condcomp.kv.selection` (KV selection); this module keeps the old import path working."""

from condcomp.kv.selection import (
    KV_FULL,
    KV_MODE_NAMES,
    KV_NONE,
    KV_WINDOW,
    HeldPlan,
    KVSelection,
    RequestPlan,
    StreamWindow,
    decision_mask,
    pad_slots,
    select_kv,
)

__all__ = ["KV_FULL", "KV_MODE_NAMES", "KV_NONE", "KV_WINDOW", "HeldPlan", "KVSelection", "RequestPlan",
           "StreamWindow", "decision_mask", "pad_slots", "select_kv"]
