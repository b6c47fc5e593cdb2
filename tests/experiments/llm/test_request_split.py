"""The per-request full/window split: per-row gates in the gated forward against masks written out from the
streaming rule, the routers' warm start against the static split, training, the router file and its errors.

Reference for the per-row forward: the unwrapped model in eager attention given a 4-D additive mask per row and
head, filled entry by entry (a query at real position p sees a key at real position j <= p; a streamed head only
when j < sinks or p - j < window), sharing no code with the gated function.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from condcomp.experiments.llm.duo_attention import RowGates, gated
from condcomp.experiments.llm.head_importance import keep_groups, warm_start_scores
from condcomp.experiments.llm.request_split import (
    RequestSettings,
    RequestSplit,
    load_router,
    routed,
    save_router,
    train_router,
)

t = pytest.importorskip("transformers")

SINKS, WINDOW = 2, 3
H, G, T = 8, 2, 12


def llama(kv_heads: int = G, attn: str = "sdpa", layers: int = 2) -> nn.Module:
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=layers, num_attention_heads=H,
                           num_key_value_heads=kv_heads, vocab_size=97, max_position_embeddings=64)
    config._attn_implementation = attn
    return t.LlamaForCausalLM(config).eval()


def padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, mask, position ids)``: two rows of T tokens, row 1 left-padded by 4."""
    ids = torch.randint(1, 97, (2, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :4] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp_min(0)


def hidden(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor:
    return model.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state


def per_row_rule(mask: torch.Tensor, streamed: list[set[int]]) -> torch.Tensor:
    """``(B, H, T, T)`` additive: causal over real tokens; row b's heads in ``streamed[b]`` also within the rule."""
    B = mask.shape[0]
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, -1).tolist()
    bias = torch.full((B, H, T, T), torch.finfo(torch.float32).min)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                p = pos[b][i]
                if p < 0:
                    bias[b, h, i] = 0.0  # a padding query: any finite row (not compared)
                    continue
                for j in range(T):
                    q = pos[b][j]
                    if 0 <= q <= p and (h not in streamed[b] or q < SINKS or p - q < WINDOW):
                        bias[b, h, i, j] = 0.0
    return bias


@pytest.mark.parametrize("per", ["group", "head"])
def test_per_row_gates_give_each_row_its_own_split(per: str) -> None:
    model, eager = llama(), llama(attn="eager")  # same weights
    ids, mask, pos = padded_batch()
    r = H // G
    groups = torch.tensor([[1.0, 0.0], [0.0, 1.0]])  # row 0 keeps group 0 in full, row 1 group 1
    gates = RowGates(2, SINKS, WINDOW)
    gates.rows = [groups if per == "group" else groups.repeat_interleave(r, -1)] * 2  # (B, G) or (B, H)
    with torch.no_grad():
        with gated(model, gates):
            got = hidden(model, ids, mask, pos)
        want = hidden(eager, ids, per_row_rule(mask, [set(range(r, H)), set(range(r))]), pos)
        swapped = hidden(eager, ids, per_row_rule(mask, [set(range(r)), set(range(r, H))]), pos)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[real], swapped[real], atol=1e-3)  # the rows' choices matter


def test_row_gates_of_a_wrong_shape_or_unset_are_refused() -> None:
    model = llama()
    ids = torch.randint(1, 97, (2, T), generator=torch.Generator().manual_seed(2))
    gates = RowGates(2, SINKS, WINDOW)
    with pytest.raises(RuntimeError, match="no per-row gates were set for layer 0"), gated(model, gates):
        model.model(input_ids=ids, use_cache=False)
    gates.rows = [torch.ones(3, G)] * 2  # 3 rows for a batch of 2
    with pytest.raises(ValueError, match=r"the gates of layer 0 have shape \(3, 2\)"), gated(model, gates):
        model.model(input_ids=ids, use_cache=False)


def importance() -> torch.Tensor:
    return torch.tensor([[0.2, 0.7], [0.9, 0.1]], dtype=torch.float64)  # layer 0 keeps group 1, layer 1 group 0


def test_the_warm_started_router_is_the_static_split_for_every_request() -> None:
    model = llama()
    split = RequestSplit(64, H, G, warm_start_scores(importance()), keep=1, sinks=SINKS, window=WINDOW).eval()
    static = keep_groups(importance(), 1)  # [[1], [0]]
    for seed in (3, 4):  # two different prompts
        ids = torch.randint(1, 97, (1, T), generator=torch.Generator().manual_seed(seed))
        assert split.choices(model, ids)[0].tolist() == static


def test_training_moves_only_the_routers_and_the_file_round_trips(tmp_path: Path) -> None:
    model = llama()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    rows = torch.randint(1, 97, (3, T), generator=torch.Generator().manual_seed(5)).tolist()
    settings = RequestSettings(steps=3, seq_len=T, lr=0.05, sinks=SINKS, window=WINDOW)
    split, history = train_router(model, rows, settings, warm_start_scores(importance()))
    assert all(torch.equal(p, before[n]) and p.requires_grad for n, p in model.named_parameters())
    assert [int(h[0]) for h in history] == [0, 2] and all(h[1] > 0 for h in history)
    assert any(float(r.scorer.weight.detach().abs().sum()) > 0 for r in split.routers)  # left their zero start
    path = tmp_path / "router.pt"
    save_router(path, split, "tiny", model, {"steps": 3}, history)
    loaded = load_router(path, model)
    assert torch.load(path, weights_only=True)["format"] == "condcomp-kv-request-router/1"
    for a, b in zip(split.routers, loaded.routers):
        assert all(torch.equal(a.scorer.state_dict()[k], b.scorer.state_dict()[k]) for k in a.scorer.state_dict())
    ids = torch.randint(1, 97, (2, T), generator=torch.Generator().manual_seed(6))
    assert torch.equal(loaded.choices(model, ids), split.choices(model, ids))


def test_the_routers_gradient_is_the_distillation_through_the_straight_through_gates() -> None:
    model = llama()
    split = RequestSplit(64, H, G, warm_start_scores(importance()), sinks=SINKS, window=WINDOW).train()
    ids = torch.randint(1, 97, (1, T), generator=torch.Generator().manual_seed(7))
    for p in model.parameters():
        p.requires_grad_(False)
    with routed(model, split) as gates:
        model.model(input_ids=ids, use_cache=False).last_hidden_state.pow(2).mean().backward()
    assert all(set(g.detach().unique().tolist()) <= {0.0, 1.0} for g in gates.rows)  # forward: the hard split
    assert all(r.scorer.weight.grad is not None and r.scorer.weight.grad.abs().sum() > 0 for r in split.routers)


def test_router_files_that_cannot_be_used_say_why(tmp_path: Path) -> None:
    model = llama()
    with pytest.raises(FileNotFoundError, match="condcomp calibrate-kv --method request --out"):
        load_router(tmp_path / "none.pt", model)
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="is not a condcomp per-request router file"):
        load_router(junk, model)
    other = tmp_path / "other.pt"
    torch.save({"format": "something-else/1"}, other)
    with pytest.raises(ValueError, match="format 'something-else/1'"):
        load_router(other, model)
    split = RequestSplit(64, H, G, warm_start_scores(importance()), sinks=SINKS, window=WINDOW)
    good = tmp_path / "good.pt"
    save_router(good, split, "tiny", model, {}, [])
    with pytest.raises(ValueError, match="train a router file for this model"):
        load_router(good, llama(layers=3))
    with pytest.raises(ValueError, match="keeps 1 to 1 of the 2 KV groups"):
        RequestSettings(keep=2, seq_len=T, sinks=SINKS, window=WINDOW).check(G)
