"""Casting a wrapped transformers model after ``apply_`` (the rule and the grid: tests/test_casts.py).

Reference: the unwrapped model cast the same way.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import condcomp

pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")
from test_hf_adapters import build  # noqa: E402

CASTS = {"bf16": lambda m: m.to(torch.bfloat16), "fp16": lambda m: m.half(), "fp64": lambda m: m.double()}
TOL = {"bf16": dict(atol=3e-2, rtol=3e-2), "fp16": dict(atol=3e-3, rtol=3e-3), "fp64": dict(atol=1e-12, rtol=1e-12)}


def _routing_dtypes(model: nn.Module) -> set[torch.dtype]:
    return {p.dtype for n, p in model.named_parameters() if "condcomp_policy" in n or "condcomp_router" in n}


@pytest.mark.parametrize("arch", ["bert", "llama"])
@pytest.mark.parametrize("cast", list(CASTS))
def test_transformers_models_after_a_cast(arch: str, cast: str) -> None:
    torch.manual_seed(0)
    ref = build(arch).eval()
    model = build(arch).eval()
    model.load_state_dict(ref.state_dict())
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="topk", executor="gathered"))
    CASTS[cast](ref)
    CASTS[cast](model)
    assert _routing_dtypes(model) == {torch.float32}
    ids = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        got, want = model(input_ids=ids), ref(input_ids=ids)
    key = "logits" if arch == "llama" else "last_hidden_state"
    torch.testing.assert_close(got[key], want[key], **TOL[cast])
    # A partial budget trains in the cast dtype too.
    condcomp.remove_(model)
    condcomp.apply_(model, condcomp.CondCompConfig(policy="budgetformer", router="topk", executor="gathered"))
    CASTS[cast](model)
    model.train()
    out = model(input_ids=ids)[key]
    (out.float().pow(2).mean() + condcomp.aux_loss(model)).backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
