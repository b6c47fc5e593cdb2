"""The pair ops as ``torch.library`` custom ops (namespace ``condcomp``), with fake implementations (shapes only, for
``torch.compile``) and autograd formulas whose backward passes are custom ops too.

- ``pair_project(x (B, T, D), weight (E, F, D), bias (E, F) | None, heads (B, C), counts (B,)) -> (B, C, T, F)``:
  pair ``(b, j)`` is ``x[b] @ weight[heads[b, j]]^T + bias[heads[b, j]]`` for ``j < counts[b]``, zeros otherwise.
- ``pair_output(a (B, C, T, Dh), weight (D, E*Dh), gates (B, C), heads (B, C), counts (B,), bias (D,) | None) ->
  (B, T, D)``: ``y[b] = sum_{j < counts[b]} gates[b, j] * a[b, j] @ weight[:, h*Dh:(h+1)*Dh]^T`` with
  ``h = heads[b, j]``, plus ``bias`` on the rows of examples with ``counts[b] > 0``.
- ``pair_row_attention(q (B, T, R, Dh), keys, values (B, Hkv, S, Dh), mask, slot (B, T, R), counts (B, T), first,
  num_routed, group, is_causal, scale) -> (out (B, T, R, Dh), lse (B, T, R))``: each selected (token, routed head)
  pair's query row attends the keys of its head (token plans): pair ``(b, t, r)``, ``r < counts[b, t]``, is head
  ``first + slot[b, t, r]`` (a token's ``R`` slots distinct, in ``[0, num_routed)``); its backward recomputes the
  probabilities from ``lse`` on the same rows.

``heads`` and ``counts`` are int64 on the same device; ``heads[b, j]`` must lie in ``[0, E)`` for ``j < counts[b]``
and ``counts[b] <= C`` (pairs past ``C`` are not computed). Those values are not checked on CUDA (that would read
the device back); the torch fallback raises on an index out of range. Weight gradients sum each head's pairs in a
fixed order (no atomics): deterministic.

>>> import torch
>>> from condcomp.executors.gathered.pairs import ops
>>> x, w = torch.ones(1, 2, 3), torch.ones(4, 5, 3)
>>> ops.pair_project(x, w, None, torch.tensor([[2, 0]]), torch.tensor([1])).sum((2, 3)).tolist()
[[30.0, 0.0]]
"""

from types import ModuleType

import torch
from torch import Tensor

from condcomp.executors.gathered.pairs import fallback, kernel_runs


def _impl(t: Tensor) -> ModuleType:
    """The Triton launchers where the kernels run on ``t``, else the torch fallback."""
    if kernel_runs(t):
        from condcomp.executors.gathered.pairs import launch

        return launch
    return fallback


def _check_plan(heads: Tensor, counts: Tensor, B: int, device: torch.device, op: str) -> None:
    if heads.dim() != 2 or heads.shape[0] != B or counts.shape != (B,):
        raise ValueError(f"{op}: heads must be (B, C) and counts (B,) with B = {B}, got heads {tuple(heads.shape)} "
                         f"and counts {tuple(counts.shape)}")
    if heads.dtype != torch.int64 or counts.dtype != torch.int64:
        raise TypeError(f"{op}: heads and counts must be int64, got {heads.dtype} and {counts.dtype}; pass .long()")
    if heads.device != device or counts.device != device:
        raise ValueError(f"{op}: heads and counts must be on {device}, got {heads.device} and {counts.device}")


def _check_project(x: Tensor, weight: Tensor, bias: Tensor | None, heads: Tensor, counts: Tensor) -> None:
    op = "pair_project"
    if x.dim() != 3 or weight.dim() != 3 or weight.shape[2] != x.shape[2]:
        raise ValueError(f"{op}: x must be (B, T, D) and weight (E, F, D), got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if bias is not None and bias.shape != weight.shape[:2]:
        raise ValueError(f"{op}: bias must be (E, F) = {tuple(weight.shape[:2])}, got {tuple(bias.shape)}")
    tensors = [weight] + ([] if bias is None else [bias])
    if any(t.dtype != x.dtype or t.device != x.device for t in tensors):
        raise TypeError(f"{op}: weight and bias must match x's dtype and device ({x.dtype} on {x.device}); cast them")
    _check_plan(heads, counts, x.shape[0], x.device, op)


def _check_output(a: Tensor, weight: Tensor, gates: Tensor, heads: Tensor, counts: Tensor,
                  bias: Tensor | None) -> None:
    op = "pair_output"
    if a.dim() != 4 or weight.dim() != 2 or weight.shape[1] % max(a.shape[3], 1):
        raise ValueError(f"{op}: a must be (B, C, T, Dh) and weight (D, E*Dh), got {tuple(a.shape)} and "
                         f"{tuple(weight.shape)}")
    if gates.shape != a.shape[:2] or not gates.is_floating_point():
        raise ValueError(f"{op}: gates must be floating point (B, C) = {tuple(a.shape[:2])}, got {gates.dtype} "
                         f"{tuple(gates.shape)}")
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"{op}: bias must be (D,) = {tuple(weight.shape[:1])}, got {tuple(bias.shape)}")
    tensors = [weight] + ([] if bias is None else [bias])
    if any(t.dtype != a.dtype or t.device != a.device for t in tensors) or gates.device != a.device:
        raise TypeError(f"{op}: weight and bias must match a's dtype and device ({a.dtype} on {a.device}) and gates "
                        "its device; cast them")
    _check_plan(heads, counts, a.shape[0], a.device, op)
    if heads.shape[1] != a.shape[1]:
        raise ValueError(f"{op}: heads {tuple(heads.shape)} must have a's C = {a.shape[1]} columns")


def _head_blocks(weight: Tensor, Dh: int) -> Tensor:
    """``weight (D, E*Dh)`` as ``(E, Dh, D)``: head ``e``'s columns, transposed (a strided view, no copy)."""
    return weight.unflatten(1, (weight.shape[1] // Dh, Dh)).permute(1, 2, 0)


# pair_project and its backward


@torch.library.custom_op("condcomp::pair_project", mutates_args=())
def pair_project(x: Tensor, weight: Tensor, bias: Tensor | None, heads: Tensor, counts: Tensor) -> Tensor:
    _check_project(x, weight, bias, heads, counts)
    return _impl(x).pair_matmul(x, weight, bias, None, heads, counts, x.dtype)


@pair_project.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, heads: Tensor, counts: Tensor) -> Tensor:
    _check_project(x, weight, bias, heads, counts)
    return x.new_empty(x.shape[0], heads.shape[1], x.shape[1], weight.shape[1])


@torch.library.custom_op("condcomp::pair_project_backward", mutates_args=())
def pair_project_backward(grad: Tensor, x: Tensor, weight: Tensor, heads: Tensor, counts: Tensor, need_x: bool,
                          need_weight: bool, need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    impl = _impl(x)
    dx = impl.pair_sum(grad, weight, None, None, heads, counts, x.dtype) if need_x else x.new_empty(0)
    dw, db = weight.new_empty(0), weight.new_empty(0)
    if need_weight or need_bias:
        dw, maybe_db = impl.group_xty(grad, x, None, heads, counts, weight.shape[0], need_bias, weight.dtype)
        db = weight.new_empty(0) if maybe_db is None else maybe_db
    return dx, dw, db


@pair_project_backward.register_fake
def _(grad: Tensor, x: Tensor, weight: Tensor, heads: Tensor, counts: Tensor, need_x: bool, need_weight: bool,
      need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    dx = x.new_empty(x.shape) if need_x else x.new_empty(0)
    dw = weight.new_empty(weight.shape) if need_weight or need_bias else weight.new_empty(0)
    db = weight.new_empty(weight.shape[:2]) if need_bias else weight.new_empty(0)
    return dx, dw, db


def _project_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    x, weight, bias, heads, counts = inputs
    ctx.save_for_backward(x, weight, heads, counts)
    ctx.has_bias = bias is not None


def _project_backward(ctx, grad: Tensor):  # type: ignore[no-untyped-def]
    x, weight, heads, counts = ctx.saved_tensors
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    need_b = bool(need_b and ctx.has_bias)
    dx, dw, db = pair_project_backward(grad, x, weight, heads, counts, need_x, need_w, need_b)
    return dx if need_x else None, dw if need_w else None, db if need_b else None, None, None


pair_project.register_autograd(_project_backward, setup_context=_project_setup)


# pair_output and its backward


@torch.library.custom_op("condcomp::pair_output", mutates_args=())
def pair_output(a: Tensor, weight: Tensor, gates: Tensor, heads: Tensor, counts: Tensor,
                bias: Tensor | None) -> Tensor:
    _check_output(a, weight, gates, heads, counts, bias)
    return _impl(a).pair_sum(a, _head_blocks(weight, a.shape[3]), gates, bias, heads, counts, a.dtype)


@pair_output.register_fake
def _(a: Tensor, weight: Tensor, gates: Tensor, heads: Tensor, counts: Tensor, bias: Tensor | None) -> Tensor:
    _check_output(a, weight, gates, heads, counts, bias)
    return a.new_empty(a.shape[0], a.shape[2], weight.shape[0])


@torch.library.custom_op("condcomp::pair_output_backward", mutates_args=())
def pair_output_backward(grad: Tensor, a: Tensor, weight: Tensor, gates: Tensor, heads: Tensor, counts: Tensor,
                         need_a: bool, need_weight: bool, need_gates: bool,
                         need_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    impl, Dh = _impl(a), a.shape[3]
    blocks = _head_blocks(weight, Dh)  # (E, Dh, D)
    da, dw, dg, db = a.new_empty(0), weight.new_empty(0), gates.new_empty(0), weight.new_empty(0)
    if need_gates:  # p[b, j] = grad[b] @ W_h, in float32 at least: the gate's gradient is sum(a * p), da = gate * p
        wide = torch.promote_types(a.dtype, torch.float32)
        p = impl.pair_matmul(grad, blocks, None, None, heads, counts, wide)  # (B, C, T, Dh)
        dg = (a.to(wide) * p).sum((2, 3)).to(gates.dtype)
        if need_a:
            da = (p * gates.to(wide)[:, :, None, None]).to(a.dtype)
    elif need_a:
        da = impl.pair_matmul(grad, blocks, None, gates, heads, counts, a.dtype)
    if need_weight:  # dW_h^T = sum over head h's pairs of gate * a[b, j]^T @ grad[b], written in weight's layout
        dw = weight.new_empty(weight.shape)
        impl.group_xty(a, grad, gates, heads, counts, blocks.shape[0], False, weight.dtype, _head_blocks(dw, Dh))
    if need_bias:
        db = (grad * (counts > 0).to(grad.dtype)[:, None, None]).sum((0, 1)).to(weight.dtype)
    return da, dw, dg, db


@pair_output_backward.register_fake
def _(grad: Tensor, a: Tensor, weight: Tensor, gates: Tensor, heads: Tensor, counts: Tensor, need_a: bool,
      need_weight: bool, need_gates: bool, need_bias: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return (a.new_empty(a.shape) if need_a else a.new_empty(0),
            weight.new_empty(weight.shape) if need_weight else weight.new_empty(0),
            gates.new_empty(gates.shape) if need_gates else gates.new_empty(0),
            weight.new_empty(weight.shape[:1]) if need_bias else weight.new_empty(0))


def _output_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    a, weight, gates, heads, counts, bias = inputs
    ctx.save_for_backward(a, weight, gates, heads, counts)
    ctx.has_bias = bias is not None


def _output_backward(ctx, grad: Tensor):  # type: ignore[no-untyped-def]
    a, weight, gates, heads, counts = ctx.saved_tensors
    need_a, need_w, need_g = ctx.needs_input_grad[:3]
    need_b = bool(ctx.needs_input_grad[5] and ctx.has_bias)
    da, dw, dg, db = pair_output_backward(grad, a, weight, gates, heads, counts, need_a, need_w, need_g, need_b)
    return da if need_a else None, dw if need_w else None, dg if need_g else None, None, None, db if need_b else None


pair_output.register_autograd(_output_backward, setup_context=_output_setup)


# pair_row_attention and its backward


def _rows_impl(t: Tensor) -> ModuleType:
    """row_launch.py where the kernels run on ``t``, else the torch fallback."""
    if kernel_runs(t):
        from condcomp.executors.gathered.pairs import row_launch

        return row_launch
    return fallback


@torch.library.custom_op("condcomp::pair_row_attention", mutates_args=())
def pair_row_attention(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, slot: Tensor, counts: Tensor,
                       first: int, num_routed: int, group: int, is_causal: bool,
                       scale: float) -> tuple[Tensor, Tensor]:
    """Attention of each selected (token, routed head) pair's query row only (row_launch.py's kernel where the
    kernels run, else fallback.py's dense routed block): ``(B, T, R, Dh)`` and the rows' log-sum-exp ``(B, T, R)``
    (float32 at least; ``+inf`` on unselected pairs and rows with no allowed key; not differentiable). Gradients
    flow to ``q``, ``keys`` and ``values`` (row_launch.py's backward kernels, no atomics), never to ``mask``."""
    return _rows_impl(q).row_attention(q, keys, values, mask, slot, counts, first, num_routed, group, is_causal,
                                       scale)


@pair_row_attention.register_fake
def _(q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, slot: Tensor, counts: Tensor, first: int,
      num_routed: int, group: int, is_causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.promote_types(q.dtype, torch.float32))


@torch.library.custom_op("condcomp::pair_row_attention_backward", mutates_args=())
def pair_row_attention_backward(grad: Tensor, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None,
                                slot: Tensor, counts: Tensor, out: Tensor, lse: Tensor, first: int, num_routed: int,
                                group: int, is_causal: bool, scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return _rows_impl(q).row_attention_backward(grad, q, keys, values, mask, slot, counts, out, lse, first,
                                                num_routed, group, is_causal, scale)


@pair_row_attention_backward.register_fake
def _(grad: Tensor, q: Tensor, keys: Tensor, values: Tensor, mask: Tensor | None, slot: Tensor, counts: Tensor,
      out: Tensor, lse: Tensor, first: int, num_routed: int, group: int, is_causal: bool,
      scale: float) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), keys.new_empty(keys.shape), values.new_empty(values.shape)


def _rows_setup(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, keys, values, mask, slot, counts, *ctx.args = inputs
    if mask is not None and mask.requires_grad:
        raise ValueError("pair_row_attention: no gradient flows to the attention mask; pass mask.detach()")
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, keys, values, mask, slot, counts, out, lse)


def _rows_backward(ctx, grad: Tensor, _grad_lse: Tensor | None):  # type: ignore[no-untyped-def]
    q, keys, values, mask, slot, counts, out, lse = ctx.saved_tensors
    dq, dk, dv = pair_row_attention_backward(grad, q, keys, values, mask, slot, counts, out, lse, *ctx.args)
    need = ctx.needs_input_grad
    return (dq if need[0] else None, dk if need[1] else None, dv if need[2] else None) + (None,) * 8


pair_row_attention.register_autograd(_rows_backward, setup_context=_rows_setup)
