"""DuoAttention gates: the gated forward against the unwrapped model and masks written out from the streaming rule,
the training objective's gradients, thresholding to a budget, the gates file and the command.

References: at gate 1 the unwrapped model (SDPA); at gate 0 (or a mix of 0 and 1 per group) the unwrapped model in
eager attention given a 4-D additive mask per head, filled entry by entry from the rule (a query at real position p
sees a key at real position j <= p when j < sinks or p - j < window); neither shares code with the gated function.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from condcomp.experiments.llm.duo_attention import DuoGates, gated
from condcomp.experiments.llm.duo_gates import (
    DuoSettings,
    calibration_rows,
    load_gates,
    save_gates,
    split_from_scores,
    train_gates,
    train_step,
)

t = pytest.importorskip("transformers")

SINKS, WINDOW = 2, 3
H, T = 8, 12


def llama(kv_heads: int, attn: str = "sdpa") -> nn.Module:
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=H,
                           num_key_value_heads=kv_heads, vocab_size=97, max_position_embeddings=64)
    config._attn_implementation = attn
    return t.LlamaForCausalLM(config).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, mask, position ids)``: three rows of T tokens, rows 1 and 2 left-padded."""
    ids = torch.randint(1, 97, (3, T), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, T, dtype=torch.long)
    mask[1, :3] = 0
    mask[2, :7] = 0
    return ids, mask, (mask.cumsum(-1) - 1).clamp_min(0)


def hidden(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor) -> torch.Tensor:
    return model.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state


def rule_mask(mask: torch.Tensor, streamed_heads: set[int]) -> torch.Tensor:
    """``(B, H, T, T)`` additive: causal attention over real tokens; a streamed head also within the rule."""
    B = mask.shape[0]
    pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, -1).tolist()
    low = torch.finfo(torch.float32).min
    bias = torch.full((B, H, T, T), low)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                p = pos[b][i]
                if p < 0:
                    bias[b, h, i] = 0.0  # a padding query: any finite row (its output is not compared)
                    continue
                for j in range(T):
                    q = pos[b][j]
                    if 0 <= q <= p and (h not in streamed_heads or q < SINKS or p - q < WINDOW):
                        bias[b, h, i, j] = 0.0
    return bias


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_every_gate_at_one_is_the_unwrapped_model(kv_heads: int) -> None:
    model = llama(kv_heads)
    ids, mask, pos = batch()
    with torch.no_grad():
        want = hidden(model, ids, mask, pos)
        with gated(model, DuoGates(2, kv_heads, SINKS, WINDOW, init=1.0)):
            got = hidden(model, ids, mask, pos)
        again = hidden(model, ids, mask, pos)  # restored on exit
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert torch.equal(again, want) and model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("kv_heads,streamed", [(8, "all"), (2, "all"), (2, "group1")])
def test_gates_at_zero_stream_exactly_the_rule(kv_heads: int, streamed: str) -> None:
    model = llama(kv_heads)
    eager = llama(kv_heads, attn="eager")  # same weights (same seed), the reference's attention
    gates = DuoGates(2, kv_heads, SINKS, WINDOW, init=0.0)
    heads = set(range(H))
    if streamed == "group1":  # group 0 full, group 1 streamed: the rule per head
        with torch.no_grad():
            gates.alpha[:, 0] = 1.0
        heads = set(range(H // kv_heads, H))
    ids, mask, pos = batch()
    with torch.no_grad():
        with gated(model, gates):
            got = hidden(model, ids, mask, pos)
        want = hidden(eager, ids, rule_mask(mask, heads), pos)
        dense = hidden(model, ids, mask, pos)
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[real], dense[real], atol=1e-3)  # the window really cut something
    assert torch.isfinite(got).all()  # padding queries give zeros, not NaN


def test_without_padding_a_no_mask_forward_also_streams_the_rule() -> None:
    model, eager = llama(2), llama(2, attn="eager")
    ids = torch.randint(1, 97, (2, T), generator=torch.Generator().manual_seed(2))
    ones = torch.ones(2, T, dtype=torch.long)
    pos = torch.arange(T).expand(2, T)
    with torch.no_grad(), gated(model, DuoGates(2, 2, SINKS, WINDOW, init=0.0)):
        got = hidden(model, ids, None, pos)
    torch.testing.assert_close(got, hidden(eager, ids, rule_mask(ones, set(range(H))), pos), atol=1e-5, rtol=1e-5)


def test_only_the_gates_get_gradients_and_the_l1_price_moves_them_down() -> None:
    model = llama(2)
    ids = torch.randint(1, 97, (1, T), generator=torch.Generator().manual_seed(3))
    gates = DuoGates(2, 2, SINKS, WINDOW, init=0.5)
    for p in model.parameters():
        p.requires_grad_(False)
    with gated(model, gates):
        model.model(input_ids=ids, use_cache=False).last_hidden_state.sum().backward()
    assert gates.alpha.grad is not None and gates.alpha.grad.abs().sum() > 0
    assert all(p.grad is None for p in model.parameters())
    # distillation alone (lambda 0) vs with a price: the price lowers every gate relative to no price
    free, priced = DuoGates(2, 2, SINKS, WINDOW, init=0.5), DuoGates(2, 2, SINKS, WINDOW, init=0.5)
    for g, l1 in ((free, 0.0), (priced, 10.0)):
        train_step(model, g, torch.optim.SGD(g.parameters(), lr=0.01), ids, l1)
    assert (priced.alpha < free.alpha).all()
    assert ((priced.alpha >= 0) & (priced.alpha <= 1)).all()


def test_training_keeps_gates_in_range_freezes_the_model_and_resumes(tmp_path: Path) -> None:
    model = llama(2)
    rows = torch.randint(1, 97, (3, T), generator=torch.Generator().manual_seed(4)).tolist()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    settings = DuoSettings(steps=4, seq_len=T, lr=0.3, l1=1.0, sinks=SINKS, window=WINDOW)
    gates, history = train_gates(model, rows, settings)
    assert ((gates.alpha >= 0) & (gates.alpha <= 1)).all() and float(gates.alpha.mean()) < 1.0
    assert all(torch.equal(p, before[n]) and p.requires_grad for n, p in model.named_parameters())
    assert [int(h[0]) for h in history] == [0, 3]
    ckpt = tmp_path / "g.partial.pt"
    half, _ = train_gates(model, rows, DuoSettings(**{**settings.__dict__, "steps": 10}), checkpoint=ckpt)
    resumed, _ = train_gates(model, rows, DuoSettings(**{**settings.__dict__, "steps": 10}), checkpoint=ckpt)
    torch.testing.assert_close(resumed.alpha, half.alpha)  # read back at step 10: nothing left to train
    with pytest.raises(ValueError, match="must exceed sinks"):
        DuoSettings(seq_len=256, sinks=4, window=252).check()


@pytest.mark.parametrize("fraction", [0.0, 1 / 3, 0.5, 2 / 3, 1.0])
def test_thresholding_keeps_exactly_the_budget_of_the_highest_gates(fraction: float) -> None:
    scores = torch.rand(30, 3, generator=torch.Generator().manual_seed(5))
    scores[4] = 1.0  # ties: the earlier layer, then the lower group
    kept = split_from_scores(scores, fraction)
    pairs = [(layer, g) for layer, groups in enumerate(kept) for g in groups]
    assert len(pairs) == round(fraction * 90) and len(set(pairs)) == len(pairs)
    ranked = sorted((-float(scores[layer, g]), layer, g) for layer in range(30) for g in range(3))
    assert {(layer, g) for _, layer, g in ranked[:len(pairs)]} == set(pairs)
    for layer, groups in enumerate(kept):  # most important first within a layer
        assert [float(scores[layer, g]) for g in groups] == sorted((float(scores[layer, g]) for g in groups),
                                                                   reverse=True)


def test_gates_file_round_trip_and_clear_errors(tmp_path: Path) -> None:
    path = tmp_path / "gates.json"
    with pytest.raises(FileNotFoundError, match="calibrate-kv --method duo"):
        load_gates(path, 2, 2)
    save_gates(path, "duo", "tiny", torch.tensor([[0.1, 0.9], [0.5, 0.2]]), 4, 252, {"steps": 1})
    record = load_gates(path, 2, 2)
    assert record["method"] == "duo" and record["scores"].tolist() == [[0.1, 0.9], [0.5, 0.2]]
    with pytest.raises(ValueError, match="needs \\(3, 2\\)"):
        load_gates(path, 3, 2)
    path.write_text(json.dumps({"scores": [[1.0]]}))
    with pytest.raises(ValueError, match="not a condcomp KV gates file"):
        load_gates(path, 1, 1)


def test_calibration_rows_hold_a_passkey_prompt_and_its_answer() -> None:
    from condcomp.bench.kv_cases import haystack_stream

    texts = [" ".join(random.Random(i).choice(["alpha", "beta", "gamma"]) for _ in range(60)) for i in range(40)]
    encode = lambda s: list(s.encode())  # noqa: E731
    stream = haystack_stream(texts, encode, 10, min_tokens=5000)
    rows = calibration_rows(stream, encode, 700, n=3, seed=0)
    for row in rows:
        text = bytes(row.ids).decode()
        assert len(row.ids) == 700 and text.count(row.key) >= 3 and "The pass key is " + row.key in text
        assert bytes(row.ids[row.answer[0]:row.answer[1]]).decode() == " " + row.key
        assert bytes(row.ids[:row.answer[0]]).decode().endswith("What is the pass key? The pass key is")
    assert calibration_rows(stream, encode, 700, n=2, seed=0) == rows[:2]  # an extended run starts the same
