"""A training run whose loss or parameters stop being finite stops there: a non-zero exit whose one-line message
names the step and the settings, and no result (gates file, router file, metrics.json) written.

Each run is made to diverge on a tiny random model by a finite but huge setting that the command line accepts
(the oracle: ``math.isfinite`` on what the run would have saved; before this check these runs wrote their file).
"""

from __future__ import annotations

import functools
import json
import random
from pathlib import Path

import pytest
import torch

from condcomp.cli import main
from condcomp.experiments.divergence import TrainingDiverged

pytest.importorskip("transformers")

TEXTS = [" ".join(random.Random(i).choice(["alpha", "beta", "gamma", "delta"]) for _ in range(80))
         for i in range(30)]
TINY = ["--model", "tiny-llama", "--steps", "12", "--seq-len", "400", "--window", "60"]


@pytest.fixture
def on_texts(monkeypatch: pytest.MonkeyPatch) -> None:
    """calibrate-kv reads TEXTS instead of the staged corpora."""
    from condcomp.experiments.llm import calibrate_kv

    monkeypatch.setattr(calibrate_kv, "run", functools.partial(calibrate_kv.run, texts=TEXTS))


@pytest.mark.parametrize("method,flags,named", [
    ("duo", ["--l1", "1e300"], "--l1 1e+300"),  # the gates' gradient overflows: inf gates after step 1
    ("request", ["--lr", "1e37"], "--lr 1e+37"),  # the routers' scores overflow: a NaN distillation
])
def test_calibrate_kv_stops_at_the_diverged_step_without_a_result(
        method: str, flags: list[str], named: str, tmp_path: Path, on_texts: None,
        capsys: pytest.CaptureFixture[str]) -> None:
    importance = tmp_path / "importance.json"
    importance.write_text(json.dumps({"group_importance": torch.rand(4, 8).tolist()}))
    out = tmp_path / ("router.pt" if method == "request" else "gates.json")
    code = main(["calibrate-kv", "--method", method, *TINY, *flags, "--importance", str(importance),
                 "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 2
    assert err.startswith("condcomp calibrate-kv: error: training diverged at step ") and named in err, err
    assert not out.exists()  # no gates / router file
    partial = out.with_suffix(".partial.pt")
    if partial.exists():  # a checkpoint, if one was saved before, holds finite numbers only
        state = torch.load(partial, weights_only=False)
        tensors = [v for v in state.get("trainable", state.get("gates", {})).values()]
        assert all(torch.isfinite(t).all() for t in tensors)


def test_tune_llm_stops_the_study_without_a_done_record(tmp_path: Path) -> None:
    pytest.importorskip("peft", reason="peft is not installed (pip install condcomp[peft])")
    import gzip

    from condcomp.experiments.llm.tuning import TuneSettings
    from condcomp.experiments.llm.tuning_study import run_tuning_study

    rng = random.Random(0)
    for name in ("ag_news", "yelp"):
        for split in ("train", "test"):
            (tmp_path / "data" / name).mkdir(parents=True, exist_ok=True)
            with gzip.open(tmp_path / "data" / name / f"{split}.jsonl.gz", "wt", encoding="utf-8") as fh:
                for _ in range(60):
                    fh.write(json.dumps({"text": "".join(rng.choice("abcdefghijklm") for _ in range(8)),
                                         "label": 0}) + "\n")

    from tiny_models import tiny_char_llama

    s = TuneSettings(seq_len=16, prompt_len=6, batch_size=2, steps=4, warmup=1, lr=1e30, lora_rank=2, eval_seqs=2,
                     calib_seqs=1, agree_prompts=2, agree_tokens=3, checkpoint_every=1, datasets=("ag_news", "yelp"),
                     tune="attention")
    with pytest.raises(TrainingDiverged, match=r"training diverged at step \d .*--lr 1e\+30"):
        run_tuning_study(s, ["dense_tuned"], tmp_path / "out", tmp_path / "results", tmp_path / "data", None,
                         tiny_char_llama)
    for folder in ("out", "results"):
        record = tmp_path / folder / "dense_tuned" / "metrics.json"
        assert not record.exists() or json.loads(record.read_text()).get("status") != "done"
