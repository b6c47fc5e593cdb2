"""The attention-function attachment (transformers' AttentionInterface): routing without a module swap, against the
unwrapped model."""

from __future__ import annotations

import pytest
import torch
from integration_helpers import kept_heads, state_equal
from test_hf_adapters import batch, build, output, real_rows, reference_with_heads

import condcomp

pytest.importorskip("transformers", reason="transformers is not installed (pip install condcomp[hf])")

from condcomp.integrations.hf.interface import (  # noqa: E402
    apply_interface_,
    interface_aux_loss,
    interface_head_usage,
    remove_interface_,
)

ARCHS = ["bert", "vit", "llama", "mistral"]


@pytest.mark.parametrize("arch", ARCHS)
def test_full_budget_parity_and_remove(arch: str) -> None:
    model = build(arch)
    inputs = batch(arch)
    want = output(model, inputs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = apply_interface_(model, condcomp.CondCompConfig(policy="full", router="random"))
    assert names and model.config._attn_implementation == "condcomp"
    rows = real_rows(arch, inputs)
    torch.testing.assert_close(output(model, inputs)[rows], want[rows], atol=1e-10, rtol=1e-9)
    usage = interface_head_usage(model)
    assert len(usage) == len(names) and all(u.k_frac == 1.0 for u in usage.values())
    remove_interface_(model)
    assert model.config._attn_implementation == "sdpa"
    assert torch.equal(output(model, inputs), want) and state_equal(model.state_dict(), before)


@pytest.mark.parametrize("arch", ARCHS)
def test_partial_budget_equals_unwrapped_model_without_the_skipped_heads(arch: str, prefer_router: str) -> None:
    model = build(arch)
    inputs = batch(arch)
    names = apply_interface_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}),
                                                            router=prefer_router))
    got = output(model, inputs)
    assert all(u.k_frac == 0.5 for u in interface_head_usage(model).values())
    remove_interface_(model)
    want = output(reference_with_heads(model, names, kept_heads(4, 0.5)), inputs)
    rows = real_rows(arch, inputs)
    torch.testing.assert_close(got[rows], want[rows], atol=1e-10, rtol=1e-9)


def test_generation_through_the_cache(prefer_router: str) -> None:
    model = build("llama")
    ids = torch.randint(2, 100, (2, 5), generator=torch.Generator().manual_seed(4))
    names = apply_interface_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}),
                                                            router=prefer_router))
    got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)
    remove_interface_(model)
    ref = reference_with_heads(model, names, kept_heads(4, 0.5))
    assert torch.equal(got, ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5,
                                         do_sample=False))


def test_learned_routing_lives_in_the_state_dict_and_trains() -> None:
    model = build("bert").train()
    apply_interface_(model, condcomp.CondCompConfig(policy=("budgetformer", {}), router="topk"))
    keys = [k for k in model.state_dict() if "condcomp_core" in k]
    assert keys and all(".attention.self.condcomp_core.condcomp_" in k for k in keys)
    loss = output(model, batch("bert")).square().mean() + interface_aux_loss(model)
    loss.backward()
    grads = [p.grad for n, p in model.named_parameters() if "condcomp_policy" in n]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    with pytest.raises(ValueError, match="already"):
        apply_interface_(model, condcomp.CondCompConfig(policy="full", router="random"))


def test_core_functions_serve_the_attention_function() -> None:
    """aux_loss, set_progress and head_usage are one code path for both attachments: with the attention function the
    budget hinge and the schedules must reach training exactly as with the module swap."""
    torch.manual_seed(0)
    swap, routed = build("bert"), build("bert")
    routed.load_state_dict(swap.state_dict())
    cfg = condcomp.CondCompConfig(policy=("budgetformer", {"s_min": 0.9, "s_max": 1.0}), router="topk",
                                  executor="masked")
    torch.manual_seed(1)
    condcomp.apply_(swap, cfg)
    torch.manual_seed(1)
    apply_interface_(routed, cfg)
    inputs = batch("bert")
    for model in (swap, routed):
        model.train()
        condcomp.set_progress(model, 0.7)
        torch.manual_seed(2)
        output(model, inputs)
    assert [h.progress for h in condcomp.api.routing_hosts(routed).values()] == [0.7, 0.7]
    loss_swap, loss_interface = condcomp.aux_loss(swap), condcomp.aux_loss(routed)
    assert float(loss_interface.detach()) > 0  # the hinge is active (s starts at 0.6, below s_min)
    torch.testing.assert_close(loss_interface, loss_swap)
    usage = condcomp.head_usage(routed)
    assert len(usage) == 2 and usage == interface_head_usage(routed)
    assert [u.s_mean for u in usage.values()] == [u.s_mean for u in condcomp.head_usage(swap).values()]
    assert interface_aux_loss(routed) is not None
    with pytest.raises(ValueError, match="remove_interface_"):
        condcomp.remove_(routed)


def test_interface_routing_stays_float32_through_a_cast() -> None:
    model = build("llama")
    apply_interface_(model, condcomp.CondCompConfig(policy="budgetformer", router="topk"))
    model.to(torch.bfloat16)
    routing = {p.dtype for n, p in model.named_parameters() if "condcomp_core" in n}
    assert routing == {torch.float32}
    out = model(input_ids=torch.randint(0, 100, (2, 5))).logits
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


def test_a_module_it_cannot_wrap_is_refused_by_name() -> None:
    """The attention-function attachment reads its modules through the module swap's wrap path: an option the
    adapter cannot honour, or a component option that does not fit the layer, is refused naming the layer, and
    nothing is attached."""
    model = build("llama")
    model.config._attn_implementation = "flex_attention"  # every layer's config: BlockMasks, which condcomp refuses
    with pytest.raises(ValueError, match=r"cannot wrap model\.layers\.0\.self_attn \(LlamaAttention\): "
                                         r"attn_implementation='flex_attention'"):
        apply_interface_(model, condcomp.CondCompConfig(policy="full", router="random"))
    model.config._attn_implementation = "sdpa"
    wrong = condcomp.CondCompConfig(policy="full", router=("topk", {"init_scores": [1.0, 2.0, 3.0]}))
    with pytest.raises(ValueError, match=r"cannot wrap model\.layers\.0\.self_attn: .*3 scores but the layer has"):
        apply_interface_(model, wrong)
    assert not [n for n, _ in model.named_modules() if n.endswith("condcomp_core")]
