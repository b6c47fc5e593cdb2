"""Builders shared by the core tests (and any test that compares executors): random layouts, weights, inputs and
plans. A uniquely named module rather than conftest.py: with several conftest.py files in the tree, ``from conftest
import`` resolves to whichever was loaded first."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from condcomp.plans import plan_from_active, top_k_mask
from condcomp.types import AttentionInputs, AttentionWeights, HeadLayout, HeadPlan

# Tolerances of "executor X equals the reference", per dtype: (atol, rtol). float64 is the exactness check
# (only summation order differs); float32 and bfloat16 check that nothing dtype-specific breaks.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-10, 1e-9),
    torch.float32: (2e-5, 1e-4),
    torch.bfloat16: (3e-2, 3e-2),
}


def make_layout(H: int = 4, Hkv: int | None = None, Dh: int = 4, D: int = 16, causal: bool = False,
                kdim: int | None = None, vdim: int | None = None) -> HeadLayout:
    return HeadLayout(d_model=D, num_heads=H, num_kv_heads=Hkv or H, head_dim=Dh, scale=Dh**-0.5, causal=causal,
                      kdim=kdim, vdim=vdim)


def make_weights(layout: HeadLayout, dtype: torch.dtype = torch.float64, bias: bool = True) -> AttentionWeights:
    """Random weights as leaf tensors that require grad (so their gradients can be compared)."""
    L = layout
    Dk, Dv = L.kdim or L.d_model, L.vdim or L.kdim or L.d_model

    def leaf(*shape: int) -> Tensor:
        return (torch.randn(*shape, dtype=torch.float64) * shape[-1] ** -0.5).to(dtype).requires_grad_()

    H, Hkv, Dh, D = L.num_heads, L.num_kv_heads, L.head_dim, L.d_model
    w = AttentionWeights(L, leaf(H * Dh, D), leaf(Hkv * Dh, Dk), leaf(Hkv * Dh, Dv), leaf(D, H * Dh))
    if bias:
        w = replace(w, q_bias=leaf(H * Dh), k_bias=leaf(Hkv * Dh), v_bias=leaf(Hkv * Dh), o_bias=leaf(D))
    return w


def weight_leaves(w: AttentionWeights) -> dict[str, Tensor]:
    names = ("q_weight", "k_weight", "v_weight", "o_weight", "q_bias", "k_bias", "v_bias", "o_bias")
    return {n: getattr(w, n) for n in names if getattr(w, n) is not None}


def fused_qkv_weights(w: AttentionWeights) -> tuple[AttentionWeights, dict[str, Tensor]]:
    """``w`` with q/k/v as slices of one in-projection leaf, as ``nn.MultiheadAttention`` and timm hold them (and
    their biases likewise when all three exist); returns it and its leaves (the fused tensors replace the slices)."""
    HD = w.q_weight.shape[0]
    in_w = torch.cat([w.q_weight, w.k_weight, w.v_weight]).detach().requires_grad_()
    w = replace(w, q_weight=in_w[:HD], k_weight=in_w[HD:2 * HD], v_weight=in_w[2 * HD:])
    if w.q_bias is not None and w.k_bias is not None and w.v_bias is not None:
        in_b = torch.cat([w.q_bias, w.k_bias, w.v_bias]).detach().requires_grad_()
        w = replace(w, q_bias=in_b[:HD], k_bias=in_b[HD:2 * HD], v_bias=in_b[2 * HD:])
        fused = {"in_proj_weight": in_w, "in_proj_bias": in_b}
    else:
        fused = {"in_proj_weight": in_w}
    leaves = {n: t for n, t in weight_leaves(w).items() if not n.startswith(("q_", "k_", "v_"))
              or (n.endswith("_bias") and "in_proj_bias" not in fused)}
    return w, {**fused, **leaves}


def random_active(shape: tuple[int, ...], ks: Tensor | None = None) -> Tensor:
    """Bool selection of shape ``(..., H)`` keeping ``ks`` (default: uniform in [0, H]) random heads per row."""
    H = shape[-1]
    if ks is None:
        ks = torch.randint(0, H + 1, shape[:-1])
    return top_k_mask(torch.rand(shape), ks)


def leaf_plan(active: Tensor, dtype: torch.dtype = torch.float64) -> tuple[HeadPlan, Tensor]:
    """A plan with random positive gates drawn as a leaf tensor (returned too, to read its gradient)."""
    gates = (torch.rand(active.shape, dtype=torch.float64) + 0.5).to(dtype).requires_grad_()
    return plan_from_active(active, gates), gates


def rotary_tables(B: int, T: int, Dh: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Rotate-half rotary ``(cos, sin)`` each ``(B, T, Dh)`` with standard inverse frequencies."""
    inv = 1.0 / (10000 ** (torch.arange(0, Dh, 2, dtype=torch.float64) / Dh))
    angles = torch.arange(T, dtype=torch.float64)[:, None] * inv[None]  # (T, Dh/2)
    angles = torch.cat((angles, angles), -1).expand(B, T, Dh)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def run_and_grads(executor: object, weights: AttentionWeights, inputs: AttentionInputs, plan: HeadPlan,
                  leaves: dict[str, Tensor], probe: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Output of ``executor`` and the gradients of ``(y * probe).sum()`` with respect to ``leaves``."""
    y = executor(weights, inputs, plan)  # type: ignore[operator]
    grads = torch.autograd.grad((y * probe).sum(), list(leaves.values()), allow_unused=True,
                                retain_graph=True)
    out = {}
    for (name, leaf), g in zip(leaves.items(), grads):
        out[name] = torch.zeros_like(leaf) if g is None else g
    return y.detach(), out


def seq_active(ks: list[int], H: int) -> Tensor:
    return top_k_mask(torch.rand(len(ks), H), torch.tensor(ks))


def moh_active(B: int, T: int, H: int, shared: int, top: int, mask: Tensor | None = None) -> Tensor:
    """MoH-style: the first ``shared`` heads always, plus the top ``top`` of the others per token."""
    routed = top_k_mask(torch.rand(B, T, H - shared), top)
    active = torch.cat([torch.ones(B, T, shared, dtype=torch.bool), routed], -1)
    return active if mask is None else active & mask.unsqueeze(-1)


class Holder(nn.Module):
    """A model holding one ``nn.MultiheadAttention`` as ``attn`` that returns the attention output only."""

    def __init__(self, d_model: int = 16, num_heads: int = 4, **mha_kwargs: Any) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, num_heads, **mha_kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.attn(*args, need_weights=False, **kwargs)[0]


def state_snapshot(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def state_equal(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    """Same keys in the same order, bit-identical tensors."""
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
