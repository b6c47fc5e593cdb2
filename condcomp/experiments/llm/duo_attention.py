"""DuoAttention's gated attention for calibration: moved to :mod:`condcomp.kv.duo_attention` (public through
:mod:`condcomp.kv.calibration`); the names are re-exported here for the studies' code."""

from __future__ import annotations

from condcomp.kv.duo_attention import (
    ATTN_NAME,
    REF_ATTR,
    DuoGates,
    GateSource,
    RowGates,
    attention_modules,
    duo_attention,
    gated,
    head_gates,
    real_positions,
    register,
)

__all__ = ["ATTN_NAME", "REF_ATTR", "DuoGates", "GateSource", "RowGates", "attention_modules", "duo_attention",
           "gated", "head_gates", "real_positions", "register"]
