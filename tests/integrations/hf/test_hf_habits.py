"""What transformers users do next with a wrapped model: gradient checkpointing, inference_mode, DataParallel-style
replication, saving the whole module. Reference: the same wrapped model without that habit (eager, no_grad, one
replica, in memory)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

import condcomp

pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")
from test_hf_adapters import build  # noqa: E402

CFG = condcomp.CondCompConfig(policy="budgetformer", router="topk", executor="gathered")


def _ids() -> torch.Tensor:
    return torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_gradient_checkpointing_gives_the_same_loss_and_routing_gradients(arch: str) -> None:
    torch.manual_seed(0)
    plain = build(arch)
    condcomp.apply_(plain, CFG)
    ckpt = copy.deepcopy(plain)
    ckpt.gradient_checkpointing_enable()
    key = "logits" if arch == "llama" else "last_hidden_state"
    for m in (plain, ckpt):
        m.train()
        torch.manual_seed(1)  # the router's training noise: the same draw in both
        out = m(input_ids=_ids(), use_cache=False)[key] if arch == "llama" else m(input_ids=_ids())[key]
        (out.pow(2).mean() + condcomp.aux_loss(m)).backward()
    grads = {n: p.grad for n, p in plain.named_parameters() if "condcomp_" in n}
    assert grads and all(g is not None for g in grads.values())
    for n, p in ckpt.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], atol=1e-10, rtol=1e-9, msg=n)


def test_inference_mode_replication_and_whole_module_save_equal_the_model() -> None:
    torch.manual_seed(0)
    model = build("llama").eval()
    condcomp.apply_(model, CFG)
    ids = _ids()
    with torch.no_grad():
        want = model(input_ids=ids).logits
    with torch.inference_mode():
        torch.testing.assert_close(model(input_ids=ids).logits, want, atol=0, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(nn.DataParallel(model)(input_ids=ids).logits, want, atol=0, rtol=0)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        again = torch.load(buf, weights_only=False)
        torch.testing.assert_close(again(input_ids=ids).logits, want, atol=0, rtol=0)
