"""apply_ / remove_ on condcomp's own HeadAttention, targeting, shared policies, set_progress, aux_loss and the
head_usage numbers (checked against hand-computed FLOPs)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from core_helpers import rotary_tables
from torch import Tensor, nn

import condcomp
from condcomp.types import AttentionWeights, Budget, HeadPlan

EXECUTORS = [*condcomp.list_executors(), "auto"]


class Block(nn.Module):
    def __init__(self, d: int, h: int, **kw: Any) -> None:
        super().__init__()
        self.attn = condcomp.HeadAttention(d, h, **kw)
        self.ff = nn.Linear(d, d)

    def forward(self, x: Tensor, mask: Tensor | None = None, **kw: Any) -> Tensor:
        return self.ff(x + self.attn(x, mask, **kw))


class Net(nn.Module):
    def __init__(self, d: int = 16, h: int = 4, layers: int = 2, **kw: Any) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, h, **kw) for _ in range(layers))

    def forward(self, x: Tensor, mask: Tensor | None = None, **kw: Any) -> Tensor:
        for block in self.blocks:
            x = block(x, mask, **kw)
        return x


def head_attention_case(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    B, T, S = 3, 5, 7
    ctor: dict[str, Any] = {}
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 2:] = False
    kw: dict[str, Any] = {"mask": mask}
    if name == "gqa_causal":
        ctor = {"num_kv_heads": 2, "causal": True}
    elif name == "cross":
        ctor = {"kdim": 12, "vdim": 10}
        kw.update(key=torch.randn(B, S, 12, dtype=torch.float64), value=torch.randn(B, S, 10, dtype=torch.float64),
                  key_mask=torch.rand(B, S) > 0.3)
    elif name == "rotary":
        kw["rotary"] = rotary_tables(B, T, 4, torch.float64)
    elif name == "attn_bias":
        kw["attn_bias"] = torch.randn(1, 4, T, T, dtype=torch.float64)
    elif name == "no_bias_head_dim":
        ctor = {"bias": False, "head_dim": 6}
    return ctor, kw


@pytest.mark.parametrize("case", ["plain", "gqa_causal", "cross", "rotary", "attn_bias", "no_bias_head_dim"])
def test_head_attention_full_budget_parity_and_exact_remove(case: str) -> None:
    ctor, kw = head_attention_case(case)
    net = Net(**ctor).double()
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    want = net(x, **kw)
    state = {k: v.clone() for k, v in net.state_dict().items()}
    originals = [b.attn for b in net.blocks]
    for executor in EXECUTORS:
        cfg = condcomp.CondCompConfig(policy="full", router="random", executor=executor)
        assert condcomp.apply_(net, cfg) == ["blocks.0.attn", "blocks.1.attn"]
        torch.testing.assert_close(net(x, **kw), want, atol=1e-10, rtol=1e-9, msg=lambda m, e=executor: f"{e}: {m}")
        condcomp.remove_(net)
        assert [b.attn for b in net.blocks] == originals
    assert torch.equal(net(x, **kw), want)
    assert list(net.state_dict()) == list(state) and all(torch.equal(net.state_dict()[k], state[k]) for k in state)


def test_targeting_patterns_and_shared_policy() -> None:
    cfg = dict(policy=("fixed", {"fraction": 0.5}), router="random")
    cases = {
        "blocks.1.attn": ["blocks.1.attn"],
        ".attn": ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"],
        r"re:blocks\.[02]\.attn": ["blocks.0.attn", "blocks.2.attn"],
    }
    for pattern, want in cases.items():
        net = Net(layers=3)
        assert condcomp.apply_(net, condcomp.CondCompConfig(**cfg, target_modules=pattern)) == want
        assert sorted(condcomp.routed_modules(net)) == want
    net = Net(layers=3)
    assert condcomp.apply_(net, condcomp.CondCompConfig(**cfg, exclude_modules=["blocks.1.attn"])) == [
        "blocks.0.attn", "blocks.2.attn"]
    net = Net(layers=2)
    condcomp.apply_(net, condcomp.CondCompConfig(**cfg, share_policy=True))
    assert net.blocks[0].attn.condcomp_policy is net.blocks[1].attn.condcomp_policy
    assert net.blocks[0].attn.condcomp_router is not net.blocks[1].attn.condcomp_router


class EveryOtherHead(nn.Module):
    """Test router: heads 0, 2, ... (so every GQA key/value group is used), binary gates; one linear layer of
    parameters whose only purpose is to be counted as routing FLOPs; an aux loss with a graph."""

    granularity = "sequence"

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, num_heads)
        self.num_heads = num_heads

    def forward(self, x: Tensor, mask: Tensor | None, budget: Budget, attn: AttentionWeights) -> HeadPlan:
        active = (torch.arange(self.num_heads) % 2 == 0).expand(x.shape[0], -1)
        return condcomp.plan_from_active(active, aux_losses={"probe": self.proj(x.float()).mean() ** 2})


class PaddingGreedyTokens(nn.Module):
    """Test router: 1 head for real tokens, every head for padding tokens (k_frac must ignore padding)."""

    granularity = "token"

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads

    def forward(self, x: Tensor, mask: Tensor | None, budget: Budget, attn: AttentionWeights) -> HeadPlan:
        assert mask is not None
        k = torch.where(mask, 1, self.num_heads)  # (B, T)
        return condcomp.plan_from_active(torch.arange(self.num_heads) < k.unsqueeze(-1))


def test_head_usage_against_hand_computed_flops(restore_registries: None) -> None:
    condcomp.register_router("test_every_other")(EveryOtherHead)
    D, H, Hkv, Dh, T = 16, 4, 2, 4, 6
    net = Net(D, H, layers=1, num_kv_heads=Hkv)
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="test_every_other")
    condcomp.apply_(net, cfg)
    net(torch.randn(2, T, D))
    usage = condcomp.head_usage(net)["blocks.0.attn"]
    assert usage.s_mean == pytest.approx(0.5) and usage.k_frac == pytest.approx(0.5)
    # Documented formula (multiply-add = 2 FLOPs), per example, S = T = 6 keys, Dk = Dv = D:
    dense = (2 * T * D * H * Dh  # queries: 3072
             + 2 * T * (D + D) * Hkv * Dh  # keys and values: 3072
             + 4 * T * T * H * Dh  # scores and attention x values: 2304
             + 2 * T * H * Dh * D)  # output projection: 3072  -> 11520
    k, kv_groups_used = 2, 2  # heads 0 and 2 belong to different key/value groups: both groups are computed
    plan = 2 * T * D * k * Dh + 2 * T * (D + D) * kv_groups_used * Dh + 4 * T * T * k * Dh + 2 * T * k * Dh * D
    routing = 2 * T * (D * H + H)  # 2 FLOPs per routing parameter per token: 816
    assert plan == 7296 and dense == 11520
    assert usage.flop_frac == pytest.approx((plan + routing) / dense)
    # aux losses come back with their graph, summed over layers
    loss = condcomp.aux_loss(net)
    assert loss.requires_grad and loss.dim() == 0
    loss.backward()
    assert net.blocks[0].attn.condcomp_router.proj.weight.grad is not None


def test_head_usage_token_plan_averages_over_real_tokens(restore_registries: None) -> None:
    condcomp.register_router("test_padding_greedy")(PaddingGreedyTokens)
    net = Net(16, 4, layers=1)
    condcomp.apply_(net, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5, "per_token": True}),
                                                router="test_padding_greedy"))
    mask = torch.ones(2, 6, dtype=torch.bool)
    mask[1, 2:] = False
    assert condcomp.head_usage(net) == {}  # nothing before the first forward
    net(torch.randn(2, 6, 16), mask)
    usage = condcomp.head_usage(net)["blocks.0.attn"]
    assert usage.k_frac == pytest.approx(0.25) and usage.s_mean == pytest.approx(0.5)


def test_aux_loss_is_zero_without_aux_losses() -> None:
    net = Net()
    condcomp.apply_(net, condcomp.CondCompConfig(policy="full", router="random"))
    net(torch.randn(1, 3, 16))
    loss = condcomp.aux_loss(net)
    assert loss.dim() == 0 and float(loss) == 0.0


class Scheduled(nn.Module):
    granularity = "sequence"
    calls: list[float] = []

    def __init__(self, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads

    def set_progress(self, p: float) -> None:
        Scheduled.calls.append(p)

    def forward(self, x: Tensor, mask: Tensor | None) -> Budget:
        s = torch.ones(x.shape[0])
        return Budget(s=s, k=condcomp.budget_k(s, self.num_heads))


def test_set_progress_steps_each_component_once(restore_registries: None) -> None:
    condcomp.register_policy("test_scheduled")(Scheduled)
    Scheduled.calls = []
    net = Net(layers=3)
    condcomp.apply_(net, condcomp.CondCompConfig(policy="test_scheduled", router="random", share_policy=True))
    condcomp.set_progress(net, 0.25)
    assert Scheduled.calls == [0.25]  # one shared policy, stepped once
    with pytest.raises(ValueError, match=r"progress must be in \[0, 1\]"):
        condcomp.set_progress(net, 1.5)


def test_apply_twice_and_remove_without_apply_are_errors() -> None:
    net = Net()
    with pytest.raises(ValueError, match="contains no RoutedAttention"):
        condcomp.remove_(net)
    condcomp.apply_(net, condcomp.CondCompConfig(policy="full", router="random"))
    with pytest.raises(ValueError, match="already wrapped"):
        condcomp.apply_(net, condcomp.CondCompConfig(policy="full", router="random"))
    with pytest.raises(ValueError, match="already wrapped"):
        condcomp.apply_(net, condcomp.CondCompConfig(policy="full", router="random", target_modules=".attn"))


def test_apply_again_on_other_targets_gives_layers_different_routing() -> None:
    net = Net(layers=3)
    first = condcomp.apply_(net, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.25}), router="random",
                                                         target_modules="blocks.0.attn"))
    rest = condcomp.apply_(net, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.75}), router="random"))
    assert first == ["blocks.0.attn"] and rest == ["blocks.1.attn", "blocks.2.attn"]
    net(torch.randn(2, 6, 16))
    usage = condcomp.head_usage(net)
    assert usage["blocks.0.attn"].k_frac == 0.25 and usage["blocks.2.attn"].k_frac == 0.75
    assert sorted(condcomp.remove_(net)) == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]


def test_wrapper_falls_back_to_the_original_attributes() -> None:
    net = Net()
    condcomp.apply_(net, condcomp.CondCompConfig(policy="full", router="random"))
    routed = net.blocks[0].attn
    assert routed.q_proj is routed.base.q_proj and routed.layout.num_heads == 4
    assert "base=HeadAttention" in repr(routed)


@pytest.mark.parametrize("executor", condcomp.list_executors())
def test_attention_dropout_only_in_training(executor: str) -> None:
    net = Net(dropout=0.5)
    condcomp.apply_(net, condcomp.CondCompConfig(policy="full", router="random", executor=executor))
    x = torch.randn(2, 6, 16)
    net.eval()
    assert torch.equal(net(x), net(x))  # eval: no dropout, no other randomness in executors
    net.train()
    assert not torch.allclose(net(x), net(x))


def test_peft_style_targets_and_unmatched_names() -> None:
    """What PEFT users write: bare names match as suffixes, one string is a regex; a typo is named, with guesses."""
    cfg = dict(policy="full", router="random")
    assert condcomp.apply_(Net(layers=3), condcomp.CondCompConfig(**cfg, target_modules=["attn"])) == [
        "blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    assert condcomp.apply_(Net(layers=3), condcomp.CondCompConfig(**cfg, target_modules=r"blocks\.[12]\.attn")) == [
        "blocks.1.attn", "blocks.2.attn"]
    with pytest.raises(ValueError, match=r"target 'atn' matches no module.*did you mean .*'attn'"):
        condcomp.apply_(Net(layers=2), condcomp.CondCompConfig(**cfg, target_modules=["attn", "atn"]))
    with pytest.raises(ValueError, match=r"matched no attention module.*did you mean .*AttentionAdapter"):
        condcomp.apply_(Net(layers=2), condcomp.CondCompConfig(**cfg, target_modules=["blocks.0.atn"]))
