"""``output_attentions=True`` on a wrapped model: wrapped layers return no attention maps, and the caller is told so
(a warning that names ``condcomp.disabled``); inside ``condcomp.disabled(model)`` the maps are the unwrapped model's.

Oracle: the unwrapped model's own ``attentions`` (eager attention, which returns them).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from arch_models import batch, build

import condcomp

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")

from condcomp.integrations.hf.interface import apply_interface_  # noqa: E402

CFG = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="topk")


def _maps(out: object) -> list[torch.Tensor]:
    return [a for key in ("attentions", "encoder_attentions", "decoder_attentions", "cross_attentions")
            for a in (getattr(out, key, None) or ())]


@pytest.mark.parametrize("arch,route", [("gpt2", "swap"), ("qwen3", "swap"),
                                        ("t5", "swap"), ("qwen3", "interface")])
def test_attention_maps_are_warned_about_and_come_back_under_disabled(arch: str, route: str) -> None:
    dense = build(arch, impl="eager").eval()
    inputs = batch(arch)
    with torch.no_grad():
        want = _maps(dense(**inputs, output_attentions=True))
    assert want and all(a.dim() == 4 for a in want)

    model = copy.deepcopy(dense)
    if route == "swap":
        condcomp.apply_(model, CFG)
    else:
        model.set_attn_implementation("sdpa")
        apply_interface_(model, CFG)
    with torch.no_grad():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(**inputs)  # not asked: no warning
        assert not [w for w in caught if "output_attentions" in str(w.message)]
        with pytest.warns(UserWarning, match=r"return no attention maps.*with condcomp\.disabled\(model\)"):
            got = _maps(model(**inputs, output_attentions=True))
        assert len(got) < len(want)  # the wrapped layers' maps are left out, as the warning says
        if route == "swap":
            with condcomp.disabled(model):
                dense_maps = _maps(model(**inputs, output_attentions=True))
            assert len(dense_maps) == len(want)
            for a, b in zip(dense_maps, want):
                torch.testing.assert_close(a, b, equal_nan=True)  # fully padded query rows: NaN in both
