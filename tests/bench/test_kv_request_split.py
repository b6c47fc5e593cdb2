"""``bench kv``'s per-request split: the wrapped model's cache holds, per request, the groups the file's routers
choose for that request (the routers' own hard top-k, run on the gated model), the others as windows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import condcomp
from condcomp.bench.kv_variants import MODELS, PLANNED_VARIANTS, REQUEST_ROUTERS, VARIANTS, ModelContext, request_split
from condcomp.experiments.llm.request_split import RequestSplit, save_router

t = pytest.importorskip("transformers")
SINKS, WINDOW = 2, 3


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=72, intermediate_size=96, num_hidden_layers=2, num_attention_heads=9,
                           num_key_value_heads=3, head_dim=8, vocab_size=97, max_position_embeddings=64)
    config._attn_implementation = "sdpa"
    return t.LlamaForCausalLM(config).eval()


def unused() -> torch.Tensor:
    raise AssertionError("a per-request split needs no importance ranking")


def test_each_request_caches_its_own_routers_choice(tmp_path: Path) -> None:
    dense = llama()
    split = RequestSplit(72, 9, 3, [[4.0, 2.0, 0.0], [0.0, 2.0, 4.0]], keep=1, sinks=SINKS, window=WINDOW)
    torch.manual_seed(1)
    with torch.no_grad():
        for r in split.routers:  # input-dependent scores (a trained router's stand-in)
            r.scorer.weight.normal_(0.0, 30.0)
    path = tmp_path / "router.pt"
    save_router(path, split, "tiny", dense, {}, [])
    model = request_split(path)(dense, ModelContext(importance=unused))
    ids = torch.randint(1, 97, (2, 10), generator=torch.Generator().manual_seed(0))  # two different prompts
    want = split.eval().choices(dense, ids)  # (2, L, 1): the routers' argmax on the gated dense model
    assert not torch.equal(want[0], want[1])  # the two requests are split differently
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    plans = list(condcomp.request_plans(model, out.past_key_values).values())
    assert [p.kept_kv_groups() for p in plans] == [[want[b, layer].tolist() for b in range(2)]
                                                   for layer in range(2)]
    modes = [p.group_modes() for p in plans]
    assert all(sorted(m) == ["full", "window", "window"] for layer in modes for m in layer)


def test_the_variants_read_the_committed_router_files() -> None:
    assert VARIANTS["split-request-1of3"].model in MODELS and VARIANTS["split-request-1of3-seed1"].model in MODELS
    assert REQUEST_ROUTERS[0].name == "request_router_seed0.pt" and not PLANNED_VARIANTS
    with pytest.raises(FileNotFoundError, match="calibrate-kv --method request"):
        request_split(Path("no/such/router.pt"))(llama(), ModelContext(importance=unused))
