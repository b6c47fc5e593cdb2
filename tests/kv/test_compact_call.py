"""The base decoder sequence on a compact cache (``condcomp.kv.decoder.attend_compact``) without transformers: a
prefill then decode steps, each a :class:`~condcomp.kv.decoder.CompactCall` of plain tensors and a cache layer of
condcomp's own (:class:`~condcomp.kv.layer.CompactLayer` over a plain storage), against the per-head reference loop
over the whole sequence (causal, left padding, float64); and the files of ``condcomp/kv/`` a decode step enters
import no transformers."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import torch
from core_helpers import make_layout, make_weights, random_active
from torch import Tensor

import condcomp
from condcomp.executors.auto import get_executor
from condcomp.executors.cached import Projections
from condcomp.kv.decoder import CompactCall, attend_compact
from condcomp.kv.layer import CompactLayer
from condcomp.kv.selection import select_kv
from condcomp.notices import Notices
from condcomp.types import AttentionInputs

B, P, STEPS, D, H, Hkv, Dh = 3, 5, 3, 16, 4, 2, 4


class Rows:
    """A plain storage layer: keys and values ``(B, g, S, Dh)`` grown along the tokens."""

    def __init__(self) -> None:
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def update(self, k: Tensor, v: Tensor, *args: object, **kwargs: object) -> tuple[Tensor, Tensor]:
        self.keys = k if self.keys is None else torch.cat([self.keys, k], 2)
        self.values = v if self.values is None else torch.cat([self.values, v], 2)
        return self.keys, self.values


class Layer(CompactLayer):
    def __init__(self) -> None:
        self.inner = Rows()

    def held_tokens(self) -> int:
        return 0 if self.inner.keys is None else int(self.inner.keys.shape[2])


def test_the_sequence_runs_a_request_on_a_plain_layer_and_equals_the_reference() -> None:
    torch.manual_seed(0)
    layout = make_layout(H=H, Hkv=Hkv, Dh=Dh, D=D, causal=True)
    w = make_weights(layout, torch.float64)
    S = P + STEPS
    x = torch.randn(B, S, D, dtype=torch.float64)
    mask = torch.ones(B, S, dtype=torch.bool)
    mask[1, :2] = False  # left padding
    active = random_active((B, H), torch.tensor([1, 2, 4]))
    plan = condcomp.plan_from_active(active, torch.rand(B, H, dtype=torch.float64) + 0.5)
    sel = select_kv(plan, layout)
    host = SimpleNamespace(executor="auto", condcomp_notices=Notices(), training=False, last=None,
                           condcomp_router=None)  # what the sequence reads of the wrapped layer
    layer, outs = Layer(), []
    for lo, hi in [(0, P)] + [(P + i, P + i + 1) for i in range(STEPS)]:
        call = CompactCall(x[:, lo:hi], mask[:, :hi], w, Projections.of_weights(w), layer, lo, prefill=lo == 0)
        with torch.no_grad():
            outs.append(attend_compact(host, plan, sel, call))
        assert host.last is not None and (host.last.T, host.last.S, host.last.executor) == (hi - lo, hi, "kv_cache")
    causal = torch.ones(S, S, dtype=torch.bool).tril() & mask[:, None, None, :]  # (B, 1, S, S)
    bias = torch.zeros(B, 1, S, S, dtype=torch.float64).masked_fill(~causal, float("-inf"))
    with torch.no_grad():
        ref = get_executor("reference")(w, AttentionInputs(x=x, mask=mask, attn_bias=bias), plan)
    torch.testing.assert_close(torch.cat(outs, 1), ref, atol=1e-10, rtol=1e-9)
    kept = int(active.view(B, Hkv, -1).any(-1).sum(-1).max())
    assert layer.inner.keys is not None and layer.inner.keys.shape == (B, kept, S, Dh)  # only the kept groups


def test_the_decode_steps_kv_files_import_no_transformers() -> None:
    # (DuoAttention's calibration, duo_attention.py, runs a transformers model and imports it inside functions)
    root = Path(condcomp.__file__).parent / "kv"
    found = []
    for name in ("decoder", "layer", "selection", "choose", "policy", "static", "window", "window_policy",
                 "window_quant", "fixed_slots", "snapkv", "adakv", "headkv", "position_bias"):
        path = root / f"{name}.py"
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] == "transformers"]
    assert found == []
