"""Every registered executor against the per-head reference: outputs and gradients, on a matrix of cases.

The executor list is read from the registry at collection time, so executors added later (``gathered``...)
are compared without new tests. Cases cover k = 0, 1 and H, variable k per row, token plans, padding, an
all-padding row, GQA, causal, cross-attention, rotary, additive biases and a KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
import torch
from core_helpers import (
    TOLERANCES,
    fused_qkv_weights,
    leaf_plan,
    make_layout,
    make_weights,
    random_active,
    rotary_tables,
    run_and_grads,
    weight_leaves,
)
from torch import Tensor

import condcomp
from condcomp.executors.auto import get_executor, resolve_executor
from condcomp.types import AttentionInputs, AttentionWeights, HeadPlan

OTHERS = [e for e in condcomp.list_executors() if e != "reference"]


@dataclass
class Case:
    weights: AttentionWeights
    inputs: AttentionInputs
    plan: HeadPlan
    leaves: dict[str, Tensor] = field(default_factory=dict)


def build_case(name: str, dtype: torch.dtype) -> Case:
    """One named situation, every differentiable input a leaf (x, key/value, weights, gates...)."""
    B, T, S, H, Dh, D = 4, 5, 5, 4, 4, 16
    Hkv, causal, kdim, vdim, bias = H, False, None, None, True
    if name.startswith("gqa"):
        Hkv = 2 if name == "gqa" else 1
    if "causal" in name or name == "kv_cache":
        causal = True
    if name == "cross":
        S, kdim, vdim = 7, 12, 10
    if name == "no_bias":
        bias = False
    layout = make_layout(H=H, Hkv=Hkv, Dh=Dh, D=D, causal=causal, kdim=kdim, vdim=vdim)
    w = make_weights(layout, dtype, bias=bias)
    if name.endswith("no_key_bias"):  # Whisper's layout: query and value biases, none on the keys
        w = replace(w, k_bias=None)
    wleaves = weight_leaves(w)
    if name == "fused_qkv":  # q/k/v as slices of one in-projection, as nn.MultiheadAttention and timm hold them
        w, wleaves = fused_qkv_weights(w)
    x = torch.randn(B, T, D, dtype=torch.float64).to(dtype).requires_grad_()
    leaves: dict[str, Tensor] = {"x": x, **wleaves}
    inputs = AttentionInputs(x=x)
    token = name.startswith("token")
    ks = torch.tensor([0, 1, H, 2])  # k = 0, 1 and H in one batch: variable k per example
    if name == "full":
        ks = torch.full((B,), H)
    active = random_active((B, T, H)) if token else random_active((B, H), ks)
    mask = None
    if name in ("padding", "token_padding", "causal_padding", "gqa", "gqa1"):
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[1, 3:] = False
        mask[2, 1:] = False
        mask[3, 0] = False  # left padding: a row with a dead prefix under causal masking
    if name == "all_padding_row":
        mask = torch.ones(B, T, dtype=torch.bool)
        mask[2] = False
    if mask is not None:
        inputs = replace(inputs, mask=mask, key_mask=mask)
        if token:
            active = active & mask.unsqueeze(-1)
    if name == "cross":
        key = torch.randn(B, S, kdim, dtype=torch.float64).to(dtype).requires_grad_()
        value = torch.randn(B, S, vdim, dtype=torch.float64).to(dtype).requires_grad_()
        key_mask = torch.ones(B, S, dtype=torch.bool)
        key_mask[0, 4:] = False
        key_mask[3] = False  # an example whose keys are all padding: finite zeros
        inputs = replace(inputs, key=key, value=value, key_mask=key_mask)
        leaves.update(key=key, value=value)
    if name == "rotary":
        inputs = replace(inputs, rotary=rotary_tables(B, T, Dh, dtype))
    if name == "attn_bias":
        bias_t = torch.randn(B, H, T, S, dtype=torch.float64)
        bias_t[0, 1, 2] = float("-inf")  # one dead (example, head, query) row
        bias_t[1, :, :, 0] = float("-inf")
        bias_t = bias_t.to(dtype).requires_grad_()
        inputs = replace(inputs, attn_bias=bias_t, mask=torch.ones(B, T, dtype=torch.bool))
        leaves["attn_bias"] = bias_t
    if name == "kv_cache":
        S = 8  # T new tokens after S - T cached ones: bottom-right aligned causal mask
        ks_ = torch.randn(B, Hkv, S, Dh, dtype=torch.float64).to(dtype).requires_grad_()
        vs_ = torch.randn(B, Hkv, S, Dh, dtype=torch.float64).to(dtype).requires_grad_()
        inputs = replace(inputs, key_states=ks_, value_states=vs_)
        leaves.update(key_states=ks_, value_states=vs_)
    plan, gates = leaf_plan(active, dtype)
    leaves["gates"] = gates
    return Case(w, inputs, plan, leaves)


CASES = ["seq_k", "full", "token", "padding", "token_padding", "all_padding_row", "gqa", "gqa1", "causal",
         "causal_padding", "cross", "rotary", "attn_bias", "kv_cache", "no_bias", "no_key_bias", "token_no_key_bias",
         "fused_qkv"]


def compare(executor_name: str, case: Case, dtype: torch.dtype) -> None:
    ex = get_executor(executor_name)
    reason = ex.supports(case.weights, case.inputs, case.plan)
    if reason is not None:
        # A declared limitation is a test of the rejection path, not a skip: auto-resolution must name it.
        assert isinstance(reason, str) and reason
        with pytest.raises(RuntimeError, match="cannot run this call"):
            resolve_executor(executor_name, case.weights, case.inputs, case.plan)
        return
    atol, rtol = TOLERANCES[dtype]
    probe = torch.randn(case.inputs.x.shape[0], case.inputs.x.shape[1], case.weights.layout.d_model,
                        dtype=torch.float64).to(dtype)
    y_ref, g_ref = run_and_grads(get_executor("reference"), case.weights, case.inputs, case.plan, case.leaves, probe)
    y, g = run_and_grads(ex, case.weights, case.inputs, case.plan, case.leaves, probe)
    assert y.shape == y_ref.shape and y.dtype == y_ref.dtype
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, y_ref, atol=atol, rtol=rtol, msg=lambda m: f"{executor_name} output: {m}")
    for name in case.leaves:
        assert torch.isfinite(g[name]).all(), f"{executor_name}: non-finite gradient for {name}"
        torch.testing.assert_close(g[name], g_ref[name], atol=atol * 10, rtol=rtol * 10,
                                   msg=lambda m, n=name: f"{executor_name} grad of {n}: {m}")


@pytest.mark.parametrize("case_name", CASES)
@pytest.mark.parametrize("executor_name", OTHERS)
def test_executor_matches_reference_float64(executor_name: str, case_name: str) -> None:
    compare(executor_name, build_case(case_name, torch.float64), torch.float64)


@pytest.mark.parametrize("case_name", ["seq_k", "token_padding", "gqa", "causal_padding", "cross", "rotary",
                                       "fused_qkv"])
@pytest.mark.parametrize("executor_name", OTHERS)
def test_executor_matches_reference_float32(executor_name: str, case_name: str) -> None:
    compare(executor_name, build_case(case_name, torch.float32), torch.float32)


@pytest.mark.parametrize("executor_name", OTHERS)
def test_executor_matches_reference_bfloat16(executor_name: str) -> None:
    compare(executor_name, build_case("padding", torch.bfloat16), torch.bfloat16)


@pytest.mark.parametrize("executor_name", condcomp.list_executors())
def test_every_executor_runs_the_basic_case(executor_name: str) -> None:
    """A float32 sequence plan without masks is the least any executor must accept."""
    case = build_case("seq_k", torch.float32)
    assert get_executor(executor_name).supports(case.weights, case.inputs, case.plan) is None


@pytest.mark.parametrize("executor_name", condcomp.list_executors())
def test_semantics_zero_heads_rows_and_inactive_gates(executor_name: str) -> None:
    """k = 0 gives exactly zero (no bias), all-padding rows give zeros, inactive gates get zero gradient."""
    case = build_case("all_padding_row", torch.float64)
    ex = get_executor(executor_name)
    if ex.supports(case.weights, case.inputs, case.plan) is not None:
        pytest.fail(f"{executor_name} rejects a float64 padded sequence plan")
    y = ex(case.weights, case.inputs, case.plan)
    assert torch.equal(y[0], torch.zeros_like(y[0]))  # example 0 has k = 0
    assert torch.equal(y[2], torch.zeros_like(y[2]))  # example 2 is all padding
    assert torch.isfinite(y).all()
    (gates_grad,) = torch.autograd.grad(y.sum(), [case.leaves["gates"]])
    assert torch.equal(gates_grad[~case.plan.active], torch.zeros_like(gates_grad[~case.plan.active]))


def hand_written_attention(w: AttentionWeights, x: Tensor, gates: Tensor, key_mask: Tensor | None) -> Tensor:
    """y = sum_h g_h softmax(Q_h K_h^T * scale) V_h W_O^h + b_O, written from the formula, whole-tensor einsums."""
    L = w.layout
    B, T, _ = x.shape
    H, Dh, G = L.num_heads, L.head_dim, L.group_size
    q = (x @ w.q_weight.T + w.q_bias).reshape(B, T, H, Dh)
    k = (x @ w.k_weight.T + w.k_bias).reshape(B, T, L.num_kv_heads, Dh).repeat_interleave(G, dim=2)
    v = (x @ w.v_weight.T + w.v_bias).reshape(B, T, L.num_kv_heads, Dh).repeat_interleave(G, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / Dh**0.5  # (B, H, T, S)
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
    a = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v)  # (B, T, H, Dh)
    g = gates[:, None, :, None] if gates.dim() == 2 else gates[..., None]  # (B, 1|T, H, 1)
    wo = w.o_weight.reshape(L.d_model, H, Dh)
    return torch.einsum("bthd,ehd->bte", a * g, wo) + w.o_bias


@pytest.mark.parametrize("granularity", ["sequence", "token"])
@pytest.mark.parametrize("Hkv", [4, 2])
def test_reference_matches_the_formula(granularity: str, Hkv: int) -> None:
    """The oracle itself against an independent float64 transcription of multi-head attention."""
    layout = make_layout(H=4, Hkv=Hkv, Dh=3, D=8)
    w = make_weights(layout)
    x = torch.randn(3, 6, 8, dtype=torch.float64)
    key_mask = torch.ones(3, 6, dtype=torch.bool)
    key_mask[1, 4:] = False
    shape = (3, 4) if granularity == "sequence" else (3, 6, 4)
    plan, gates = leaf_plan(random_active(shape))
    got = get_executor("reference")(w, AttentionInputs(x=x, mask=key_mask, key_mask=key_mask), plan)
    want = hand_written_attention(w, x, plan.gates, key_mask)
    # rows without any active head get no output bias (documented executor semantics)
    no_head = (plan.counts == 0)[:, None] if granularity == "sequence" else (plan.counts == 0)
    want = want - w.o_bias * no_head.expand(3, 6).unsqueeze(-1)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_reference_matches_torch_multi_head_attention_forward() -> None:
    """At full budget the oracle equals PyTorch's own MHA, causal mask and key padding included."""
    layout = make_layout(H=4, Dh=4, D=16, causal=True)
    w = make_weights(layout)
    B, T = 2, 5
    x = torch.randn(B, T, 16, dtype=torch.float64)
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, 3:] = True  # torch: True = padding
    causal = torch.ones(T, T, dtype=torch.bool).triu(1)
    xt = x.transpose(0, 1)
    want, _ = torch.nn.functional.multi_head_attention_forward(
        xt, xt, xt, 16, 4, None, torch.cat([w.q_bias, w.k_bias, w.v_bias]), None, None, False, 0.0, w.o_weight,
        w.o_bias, training=False,
        key_padding_mask=pad, need_weights=False, attn_mask=causal, use_separate_proj_weight=True,
        q_proj_weight=w.q_weight, k_proj_weight=w.k_weight, v_proj_weight=w.v_weight)
    plan = condcomp.full_plan(B, 4, x.device)
    got = get_executor("reference")(w, AttentionInputs(x=x, mask=~pad, key_mask=~pad), plan)
    torch.testing.assert_close(got, want.transpose(0, 1), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("granularity", ["sequence", "token"])
@pytest.mark.parametrize("executor_name", condcomp.list_executors())
def test_gradcheck_float64(executor_name: str, granularity: str) -> None:
    """Analytic gradients against finite differences (tiny shapes, padding, GQA, one k = 0 row)."""
    layout = make_layout(H=2, Hkv=1, Dh=2, D=4)
    w = make_weights(layout)
    B, T = 2, 3
    mask = torch.tensor([[True, True, False], [True, True, True]])
    active = torch.tensor([[True, False], [True, True]])
    if granularity == "token":
        active = torch.tensor([[[True, False], [False, False], [False, False]], [[True, True], [False, True],
                                                                                 [True, True]]])
    gates0 = torch.rand(active.shape, dtype=torch.float64) + 0.5
    x0 = torch.randn(B, T, 4, dtype=torch.float64)
    ex = get_executor(executor_name)
    names = ("q_weight", "k_weight", "v_weight", "o_weight", "q_bias", "o_bias")

    def f(x: Tensor, gates: Tensor, *params: Tensor) -> Tensor:
        weights = replace(w, **dict(zip(names, params)))
        plan = condcomp.plan_from_active(active, gates)
        return ex(weights, AttentionInputs(x=x, mask=mask, key_mask=mask), plan)

    args = (x0.requires_grad_(), gates0.requires_grad_(), *(getattr(w, n).detach().requires_grad_() for n in names))
    plan0 = condcomp.plan_from_active(active, gates0)
    if ex.supports(w, AttentionInputs(x=x0, mask=mask, key_mask=mask), plan0) is not None:
        pytest.fail(f"{executor_name} rejects a tiny float64 {granularity} plan")
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-5, fast_mode=True)


def _formula(w: AttentionWeights, q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, gates: Tensor) -> Tensor:
    """sum_h g_h softmax(q_h k_h^T * scale | allowed) v_h W_O^h + b_O; q (B,T,H,Dh), k/v (B,S,H,Dh)."""
    scores = torch.einsum("bthd,bshd->bhts", q, k) * w.layout.scale
    a = torch.einsum("bhts,bshd->bthd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    wo = w.o_weight.reshape(w.layout.d_model, w.layout.num_heads, w.layout.head_dim)
    return torch.einsum("bthd,ehd->bte", a * gates[:, None, :, None], wo) + w.o_bias


def _rotate(t: Tensor, angles: Tensor) -> Tensor:
    """Rotary embedding as a complex rotation of the pairs (j, j + Dh/2): t (B, T, H, Dh), angles (T, Dh/2)."""
    half = t.shape[-1] // 2
    z = torch.complex(t[..., :half], t[..., half:]) * torch.polar(torch.ones_like(angles), angles)[:, None]
    return torch.cat((z.real, z.imag), -1)


@pytest.mark.parametrize("situation", ["cross", "rotary", "kv_cache"])
def test_reference_matches_the_formula_with_context(situation: str) -> None:
    """Cross-attention, rotary embeddings and a KV cache, each transcribed independently of condcomp's helpers."""
    B, T, H, Dh, D = 2, 4, 2, 4, 8
    causal = situation == "kv_cache"
    kdim, vdim = (6, 5) if situation == "cross" else (None, None)
    w = make_weights(make_layout(H=H, Dh=Dh, D=D, causal=causal, kdim=kdim, vdim=vdim))
    x = torch.randn(B, T, D, dtype=torch.float64)
    q = (x @ w.q_weight.T + w.q_bias).reshape(B, T, H, Dh)
    plan, _ = leaf_plan(torch.tensor([[True, True], [False, True]]))
    if situation == "cross":
        S = 5
        key, value = torch.randn(B, S, 6, dtype=torch.float64), torch.randn(B, S, 5, dtype=torch.float64)
        key_mask = torch.tensor([[True] * 5, [True, True, False, True, False]])
        k = (key @ w.k_weight.T + w.k_bias).reshape(B, S, H, Dh)
        v = (value @ w.v_weight.T + w.v_bias).reshape(B, S, H, Dh)
        allowed = key_mask[:, None, None, :].expand(B, H, T, S)
        inputs = AttentionInputs(x=x, key=key, value=value, key_mask=key_mask)
    elif situation == "rotary":
        S = T
        angles = torch.arange(T, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(Dh // 2) / (Dh // 2))
        k = _rotate((x @ w.k_weight.T + w.k_bias).reshape(B, S, H, Dh), angles)
        v = (x @ w.v_weight.T + w.v_bias).reshape(B, S, H, Dh)
        q = _rotate(q, angles)
        allowed = torch.ones(B, H, T, S, dtype=torch.bool)
        inputs = AttentionInputs(x=x, rotary=rotary_tables(B, T, Dh, torch.float64))
    else:
        S = 7  # 3 cached positions, then the T = 4 new queries at absolute positions 3..6
        k, v = torch.randn(B, S, H, Dh, dtype=torch.float64), torch.randn(B, S, H, Dh, dtype=torch.float64)
        position = torch.arange(T)[:, None] + (S - T)
        allowed = (torch.arange(S)[None, :] <= position).expand(B, H, T, S)
        inputs = AttentionInputs(x=x, key_states=k.transpose(1, 2), value_states=v.transpose(1, 2))
    want = _formula(w, q, k, v, allowed, plan.gates)
    got = get_executor("reference")(w, inputs, plan)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
