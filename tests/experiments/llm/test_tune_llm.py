"""``condcomp tune-llm`` on a tiny random Llama (no download): packing, the continuation-only loss against a
manual float64 computation, resume, the static router against the model with those heads' outputs removed by
hand, Michel et al.'s importance against finite differences in float64, and the study end to end."""

from __future__ import annotations

import copy
import gzip
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from condcomp.routers.static import StaticRouter

import condcomp
from condcomp.experiments.llm.data import pack_documents, packed_split, split_calibration
from condcomp.experiments.llm.evaluation import agreement, continuation_nll, kept_groups, plan_variety
from condcomp.experiments.llm.head_importance import (
    group_heads,
    group_importance,
    head_gradients,
    keep_groups,
    warm_start_scores,
)
from condcomp.experiments.llm.tuning import TuneSettings, make_trainable, tune
from condcomp.experiments.llm.variants import apply_variant
from condcomp.types import Budget

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")

H, G, LAYERS, VOCAB = 4, 2, 2, 97


def tiny_llama(seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS,
                                   num_attention_heads=H, num_key_value_heads=G, vocab_size=VOCAB,
                                   max_position_embeddings=64, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).to(dtype).eval()


def ids(B: int = 3, T: int = 12, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------------ packing
def test_pack_documents_starts_every_sequence_at_a_document_and_drops_cut_remainders() -> None:
    docs = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11, 12], [13]]
    assert pack_documents(docs, 4, sep_id=0) == [[1, 2, 3, 0], [4, 0, 5, 6], [11, 12, 0, 13]]
    assert pack_documents(docs, 4, sep_id=0, limit=2) == [[1, 2, 3, 0], [4, 0, 5, 6]]


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in rows)


def staged(tmp_path: Path) -> Path:
    """ag_news and yelp stand-ins: train texts of letters a-m, test texts of n-z, so a leak is visible."""
    rng = torch.Generator().manual_seed(0)
    for name in ("ag_news", "yelp"):
        for split, letters in (("train", "abcdefghijklm"), ("test", "nopqrstuvwxyz")):
            rows = [{"text": "".join(letters[int(i)] for i in torch.randint(0, 13, (int(n),), generator=rng)),
                     "label": 0} for n in torch.randint(3, 9, (60,), generator=rng)]
            _write(tmp_path / name / f"{split}.jsonl.gz", rows)
    return tmp_path


def char_encode(texts: list[str]) -> list[list[int]]:
    return [[ord(c) for c in t] for t in texts]


def test_packed_splits_hold_the_test_split_out_and_interleave_datasets(tmp_path: Path) -> None:
    data = staged(tmp_path)
    train = packed_split(char_encode, data, "train", 6, 16, sep_id=1, datasets=("ag_news", "yelp"))
    test = packed_split(char_encode, data, "test", 3, 16, sep_id=1, datasets=("ag_news", "yelp"))
    assert train.ids.shape == (12, 16) and test.ids.shape == (6, 16)
    assert train.sources == ["ag_news", "yelp"] * 6
    train_chars = {chr(int(t)) for t in train.ids.flatten() if t != 1}
    test_chars = {chr(int(t)) for t in test.ids.flatten() if t != 1}
    assert train_chars <= set("abcdefghijklm") and test_chars <= set("nopqrstuvwxyz")
    assert (train.ids[:, 0] != 1).all()  # every row starts with a document's first token
    tuning, calib = split_calibration(train, 2, ("ag_news", "yelp"))
    assert tuning.ids.shape[0] == 8 and calib.ids.shape[0] == 4
    assert not any(torch.equal(c, t) for c in calib.ids for t in tuning.ids)
    with pytest.raises(ValueError, match="ag_news"):
        packed_split(char_encode, data, "test", 500, 16, sep_id=1, datasets=("ag_news",))


# ----------------------------------------------------------------------------------------- continuation loss
def test_continuation_nll_equals_a_manual_float64_computation() -> None:
    model, x, P = tiny_llama(dtype=torch.float64), ids(), 5
    got = continuation_nll(model, x, P)
    with torch.no_grad():
        logits = model(input_ids=x).logits  # every position, computed the plain way
    want = torch.empty(x.shape[0], x.shape[1] - P, dtype=torch.float64)
    for b in range(x.shape[0]):
        for t in range(P, x.shape[1]):  # token t is predicted at position t - 1
            row = logits[b, t - 1]
            want[b, t - P] = torch.logsumexp(row, 0) - row[x[b, t]]
    assert got.dtype == torch.float64
    torch.testing.assert_close(got.detach(), want, rtol=1e-10, atol=1e-12)


def test_a_per_request_plan_is_decided_from_the_prompt_so_no_continuation_token_sees_the_future() -> None:
    model = tiny_llama(dtype=torch.float64)
    torch.manual_seed(0)
    apply_variant(model, "request_1of3", "auto")
    with torch.no_grad():
        for m in condcomp.routed_modules(model).values():
            m.condcomp_router.scorer.weight.mul_(50.0)  # scores swing with the pooled input: plans flip easily
    x, P = ids(B=4, T=24), 5
    y = x.clone()
    y[:, 12:] = torch.randint(3, VOCAB, (4, 12), generator=torch.Generator().manual_seed(9))  # another tail
    with torch.no_grad():
        a, b = continuation_nll(model, x, P), continuation_nll(model, y, P)
    torch.testing.assert_close(a[:, :12 - P], b[:, :12 - P], rtol=0, atol=1e-12)  # tokens before the new tail
    assert condcomp.head_usage(model)["model.layers.0.self_attn"].k_frac == 0.5  # one of the 2 groups


def test_agreement_counts_positions_and_common_prefixes() -> None:
    got = agreement(torch.tensor([[5, 6, 7, 8], [5, 0, 7, 8]]), torch.tensor([[5, 6, 7, 9], [5, 6, 7, 8]]))
    assert got == {"token_agreement": 6 / 8, "prefix_agreement": (3 / 4 + 1 / 4) / 2}


# ---------------------------------------------------------------------------------------------------- resume
def _routed_lora(seed: int) -> Any:
    peft = pytest.importorskip("peft", reason="peft is not installed (pip install condcomp[peft])")
    assert peft
    model = tiny_llama()
    torch.manual_seed(seed)  # routing and LoRA initialisation
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="topk"))
    return make_trainable(model, SETTINGS)


SETTINGS = TuneSettings(seq_len=12, prompt_len=4, batch_size=2, steps=4, warmup=1, lora_rank=2, eval_seqs=1,
                        checkpoint_every=1, lr=1e-2)


@pytest.mark.slow
def test_a_stopped_run_resumes_from_its_checkpoint_and_ends_where_an_uninterrupted_one_does(tmp_path: Path) -> None:
    data = ids(B=6, T=12, seed=3)
    whole = _routed_lora(7)
    full = tune(whole, data, SETTINGS, tmp_path / "a.pt")
    first = _routed_lora(7)
    part = tune(first, data, SETTINGS, tmp_path / "b.pt", stop_after=2)
    assert part["step"] == 2 and (tmp_path / "b.pt").is_file()
    again = _routed_lora(7)  # a new process: fresh model, same initialisation, then the checkpoint
    calls = []
    again.register_forward_pre_hook(lambda *_: calls.append(1))
    rest = tune(again, data, SETTINGS, tmp_path / "b.pt")
    assert len(calls) == 2, "the resumed run must run only the two missing steps"
    assert [h["loss"] for h in rest["history"]] == pytest.approx([h["loss"] for h in full["history"]], rel=1e-5)
    want = {n: p for n, p in whole.named_parameters() if p.requires_grad}
    got = {n: p for n, p in again.named_parameters() if p.requires_grad}
    assert want.keys() == got.keys() and any("condcomp_router" in n for n in got)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=n)
    moved = {n: p for n, p in _routed_lora(7).named_parameters() if p.requires_grad}
    assert any(not torch.allclose(moved[n], want[n]) for n in want), "tuning changed nothing"
    with pytest.raises(ValueError, match="other settings"):
        tune(_routed_lora(7), data, TuneSettings(**{**SETTINGS.__dict__, "lr": 0.5}), tmp_path / "b.pt")


def test_router_lr_sets_the_routing_parameters_step_apart_from_the_adapters(tmp_path: Path) -> None:
    """Adam's first step moves every parameter with a gradient by exactly its learning rate (times the warm-up
    factor, 1 here), whatever the gradient's size: the largest move per group is its learning rate."""
    model = _routed_lora(7)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    settings = TuneSettings(**{**SETTINGS.__dict__, "router_lr": 0.1})
    tune(model, ids(B=6, T=12, seed=3), settings, tmp_path / "c.pt", stop_after=1)
    moved = {n: float((p.detach() - before[n]).abs().max()) for n, p in model.named_parameters() if n in before}
    router = max(v for n, v in moved.items() if "condcomp_router" in n)
    lora = max(v for n, v in moved.items() if "lora_" in n)
    assert router == pytest.approx(0.1, rel=1e-3) and lora == pytest.approx(SETTINGS.lr, rel=1e-3)
    assert "router_lr" in settings.tuning_key() and "router_lr" not in SETTINGS.tuning_key()
    with pytest.raises(ValueError, match=r"router_lr .* must be a finite number > 0"):
        TuneSettings(router_lr=0.0)


# ----------------------------------------------------------------------------------------------- static router
def test_static_router_keeps_a_prefix_of_its_ranking_and_checks_options() -> None:
    r = StaticRouter(num_heads=4, heads=[2, 0, 3])
    plan = r(torch.randn(3, 2, 8), None, Budget(torch.ones(3), torch.tensor([4, 2, 1])), None)
    assert plan.active.tolist() == [[True, False, True, True], [True, False, True, False],
                                    [False, False, True, False]]
    assert plan.gates.tolist() == plan.active.float().tolist()
    with pytest.raises(ValueError, match="outside"):
        StaticRouter(num_heads=4, heads=[4])
    with pytest.raises(ValueError, match="twice"):
        condcomp.CondCompConfig(router=("static", {"heads": [1, 1]}))


@pytest.mark.parametrize("executor", ["reference", "gathered", "auto"])
def test_static_variant_equals_the_model_with_the_other_heads_removed_by_hand(executor: str) -> None:
    keep = [[0], [1]]  # layer 0 keeps KV group 0, layer 1 group 1
    heads = [group_heads(g, H, G) for g in keep]
    dense = tiny_llama(dtype=torch.float64)
    pruned = _remove_heads_by_hand(dense, heads)
    routed = copy.deepcopy(dense)
    apply_variant(routed, "static_1of3", executor, heads)
    x = ids()
    with torch.no_grad():
        want, got = pruned(input_ids=x).logits, routed(input_ids=x).logits
        full = dense(input_ids=x).logits
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(full, want, atol=1e-3)  # the removal mattered
    usage = condcomp.head_usage(routed)
    assert all(u.k_frac == pytest.approx(0.5) for u in usage.values())


def _remove_heads_by_hand(dense: Any, heads: list[list[int]]) -> Any:
    """A copy of ``dense`` whose heads outside ``heads[l]`` contribute nothing through the output projection."""
    pruned = copy.deepcopy(dense)
    with torch.no_grad():
        for layer, kept in zip(pruned.model.layers, heads):
            Dh = 32 // H
            for h in range(H):
                if h not in kept:
                    layer.self_attn.o_proj.weight[:, h * Dh:(h + 1) * Dh] = 0.0
    return pruned


def test_a_warm_started_request_variant_begins_as_static_pruning_of_the_importance_ranking() -> None:
    """Before tuning, whatever the input, it keeps the groups static pruning keeps: the hand-pruned model's logits;
    its scorer weights are zero but trainable, so tuning can move away from the prior."""
    scores = torch.tensor([[0.1, 0.7], [0.9, 0.2]])  # layer 0 keeps group 1, layer 1 group 0
    dense = tiny_llama(dtype=torch.float64)
    pruned = _remove_heads_by_hand(dense, [group_heads(g, H, G) for g in keep_groups(scores, 1)])
    routed = copy.deepcopy(dense)
    apply_variant(routed, "request_1of3_warm", "auto", warm_scores=warm_start_scores(scores))
    x = ids(B=4, T=12)
    with torch.no_grad(), condcomp.plan_from_prompt(routed, 5):
        got = routed(input_ids=x).logits
        want = pruned(input_ids=x).logits
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    kept = kept_groups(routed)
    assert [g[0].tolist() for g in kept.values()] == [[False, True], [True, False]]
    assert plan_variety(kept) == 0.0  # every request the same groups
    with pytest.raises(ValueError, match="warm_scores"):
        apply_variant(copy.deepcopy(dense), "request_1of3_warm", "auto")


# -------------------------------------------------------------------------------------------- head importance
def _rms_norm_float64(self: Any, h: torch.Tensor) -> torch.Tensor:
    return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def test_group_importance_matches_float64_finite_differences(monkeypatch: pytest.MonkeyPatch) -> None:
    # Llama's RMSNorm rounds through float32; finite differences need the whole forward in float64.
    monkeypatch.setattr(transformers.models.llama.modeling_llama.LlamaRMSNorm, "forward", _rms_norm_float64)
    model, x, P, eps = tiny_llama(dtype=torch.float64), ids(B=3, T=10), 4, 1e-6

    def loss_fn(m: Any, batch: torch.Tensor) -> torch.Tensor:
        return continuation_nll(m, batch, P).mean(-1)

    got = group_importance(head_gradients(model, [x[:2], x[2:]], loss_fn, H), G)  # two batches, three examples
    Dh, rep = 32 // H, H // G
    want = torch.zeros(LAYERS, G, dtype=torch.float64)
    with torch.no_grad():
        for layer in range(LAYERS):
            W = model.model.layers[layer].self_attn.o_proj.weight
            for g in range(G):
                cols = slice(g * rep * Dh, (g + 1) * rep * Dh)  # scaling the group's columns scales its output
                saved = W[:, cols].clone()
                W[:, cols] = saved * (1 + eps)
                up = loss_fn(model, x)
                W[:, cols] = saved * (1 - eps)
                down = loss_fn(model, x)
                W[:, cols] = saved
                want[layer, g] = ((up - down) / (2 * eps)).abs().mean()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
    assert all(not p.requires_grad or p.grad is None for p in model.parameters())
    assert keep_groups(torch.tensor([[0.1, 0.3], [0.5, 0.2]]), 1) == [[1], [0]]


# ------------------------------------------------------------------------------------------------ end to end
class CharTokenizer:
    pad_token_id, eos_token_id = 1, 2

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict[str, Any]:
        return {"input_ids": [[3 + (ord(c) % 90) for c in t] for t in texts]}

    def get_vocab(self) -> dict[str, int]:
        return {"<|endoftext|>": 0}

    def decode(self, tokens: Any) -> str:
        return "".join(chr(int(t)) for t in tokens)


@pytest.mark.slow
def test_the_study_writes_metrics_for_each_variant_and_reuses_finished_ones(tmp_path: Path) -> None:
    pytest.importorskip("peft", reason="peft is not installed (pip install condcomp[peft])")
    from condcomp.experiments.llm.tuning_study import run_tuning_study

    data = staged(tmp_path / "data")
    s = TuneSettings(seq_len=16, prompt_len=6, batch_size=2, steps=2, warmup=1, lora_rank=2, eval_seqs=2,
                     calib_seqs=1, agree_prompts=2, agree_tokens=3, checkpoint_every=1, datasets=("ag_news", "yelp"))
    variants = ["dense_untuned", "static_1of3", "moh_50", "request_1of3", "request_1of3_warm"]
    loads = []

    def loader() -> tuple[Any, Any]:
        loads.append(1)
        return tiny_llama(), CharTokenizer()

    table = run_tuning_study(s, variants, tmp_path / "out", tmp_path / "results", data, "cmd", loader)
    records = {v: json.loads((tmp_path / "results" / v / "metrics.json").read_text()) for v in variants}
    if not hasattr(condcomp, "plan_from_prompt"):
        assert records.pop("request_1of3")["status"] == "skipped"
    assert all(r["status"] == "done" for r in records.values()), records
    assert records["dense_untuned"]["agreement"]["token_agreement"] == 1.0
    assert records["static_1of3"]["kv_fraction"] == 0.5  # measured from the plans: 1 of the tiny model's 2 groups
    assert records["request_1of3_warm"]["kv_fraction"] == 0.5
    assert records["static_1of3"]["plan_variety"] == 0.0 and records["moh_50"]["plan_variety"] is None
    assert records["static_1of3"]["tuning"]["steps"] == 2 and records["moh_50"]["kv_fraction"] == 1.0
    assert math.isfinite(records["moh_50"]["perplexity"]["ppl"]) and "| static_1of3 |" in table
    assert (tmp_path / "results" / "static_importance.json").is_file()
    assert not list((tmp_path / "results").rglob("checkpoint.pt"))
    before = (tmp_path / "out" / "moh_50" / "metrics.json").stat().st_mtime_ns
    run_tuning_study(s, ["moh_50"], tmp_path / "out", None, data, None, loader)
    assert (tmp_path / "out" / "moh_50" / "metrics.json").stat().st_mtime_ns == before  # read back, not rerun


def test_the_summary_joins_the_decode_benchmark_by_kept_fraction(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """--report-only --decode-results: each row gets the committed benchmark's cell at prompt 2048, batch 8 for
    its kept KV fraction (MoH: its own cell, dense: dense); BudgetFormer (a varying fraction) gets none."""
    from condcomp.cli import main

    root = Path(__file__).resolve().parents[3] / "results" / "bench" / "decode"
    folders = [root / "smollm2_cpu", root / "smollm2_moh_cpu"]
    bench = [r for f in folders for r in json.loads((f / "metrics.json").read_text())["records"]]
    cell = {(r["variant"], r["prompt"], r["batch"]): r for r in bench}
    rows = {"dense_tuned": 1.0, "moh_75": 1.0, "static_1of3": 1 / 3, "request_2of3": 2 / 3, "budgetformer": 0.5}
    for name, kv in rows.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps({
            "variant": name, "status": "done", "kv_fraction": kv, "k_frac": kv, "s_mean": None,
            "perplexity": {"ppl": 40.0, "per_dataset": {}}, "agreement": {"token_agreement": 0.5}}))
    args = ["tune-llm", "--report-only", "--out", str(tmp_path), "--decode-results", *map(str, folders)]
    assert main(args) == 0
    got = {r["variant"]: r.get("decode") for r in json.loads((tmp_path / "summary.json").read_text())}
    for name, want in [("dense_tuned", "dense"), ("moh_75", "moh_0.75"), ("static_1of3", "keep_0.33"),
                       ("request_2of3", "keep_0.67")]:
        ref = cell[(want, 2048, 8)]
        assert got[name]["ratio"] == ref["decode_ratio"] and got[name]["kv_bytes"] == ref["kv_bytes"], name
    assert got["budgetformer"] is None
    assert "decode x dense (P2048 B8)" in (tmp_path / "summary.md").read_text()
    # the documented `--report-only --results results/llm` without a run folder (--out defaults to runs/llm)
    assert main(["tune-llm", "--report-only", "--out", str(tmp_path / "no_run"), "--results", str(tmp_path)]) == 0
    # refused: no file, another model's benchmark, a tune-llm metrics.json, a corrupt file
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    tiny_records = [{**bench[0], "model": "tiny-llama"}]
    (tiny / "metrics.json").write_text(json.dumps({"benchmark": "decode", "records": tiny_records}))
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text("{")
    for bad, message in [(tmp_path / "nowhere", "no metrics.json"), (tiny, "measured tiny-llama"),
                         (tmp_path / "dense_tuned", "not the metrics.json of `condcomp bench decode`"),
                         (corrupt, "not valid JSON")]:
        assert main(["tune-llm", "--report-only", "--out", str(tmp_path), "--decode-results", str(bad)]) != 0
        assert message in capsys.readouterr().err


def test_plan_variety_counts_requests_off_each_layers_most_common_set() -> None:
    a = torch.tensor([[1, 0, 1], [1, 0, 1], [0, 1, 1], [1, 0, 1]]).bool()  # 1 of 4 off the modal set
    b = torch.tensor([[1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 0]]).bool()  # 2 of 4 off
    assert plan_variety({"a": a, "b": b}) == pytest.approx((0.25 + 0.5) / 2)
    assert plan_variety({}) is None
