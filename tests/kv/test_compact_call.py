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
from plain_cache import STEPS, B, Dh, Hkv, Layer, P, reference, request, steps

import condcomp
from condcomp.executors.cached import Projections
from condcomp.kv.decoder import CompactCall, attend_compact
from condcomp.notices import Notices


def test_the_sequence_runs_a_request_on_a_plain_layer_and_equals_the_reference() -> None:
    r = request()
    w, x, mask, plan, sel = r["w"], r["x"], r["mask"], r["plan"], r["sel"]
    host = SimpleNamespace(executor="auto", condcomp_notices=Notices(), training=False, last=None,
                           condcomp_router=None)  # what the sequence reads of the wrapped layer
    layer, outs = Layer(), []
    for lo, hi in steps():
        call = CompactCall(x[:, lo:hi], mask[:, :hi], w, Projections.of_weights(w), layer, lo, prefill=lo == 0)
        with torch.no_grad():
            outs.append(attend_compact(host, plan, sel, call))
        assert host.last is not None and (host.last.T, host.last.S, host.last.executor) == (hi - lo, hi, "kv_cache")
    torch.testing.assert_close(torch.cat(outs, 1), reference(r), atol=1e-10, rtol=1e-9)
    kept = int(r["active"].view(B, Hkv, -1).any(-1).sum(-1).max())
    assert layer.inner.keys is not None and layer.inner.keys.shape == (B, kept, P + STEPS, Dh)  # only the kept groups


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
