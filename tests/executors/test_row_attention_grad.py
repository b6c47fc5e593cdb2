"""The backward of ``torch.ops.condcomp.pair_row_attention`` (token.triton's attention of the selected (token, routed
head) pairs' rows): outputs and ``dq``/``dk``/``dv`` against a float64 loop over the pairs, one softmax per pair
(autograd through it gives the reference gradients), and ``torch.autograd.gradcheck`` of the torch fallback in
float64. With ``TRITON_INTERPRET=1`` set before the process starts the float32 cases run the Triton kernels
(row_kernels.py: the forward with its log-sum-exp, ``row_attention_dq``, ``row_attention_dkdv``) and the torch
fallback is patched to fail on float32, so nothing passes by falling back; tolerance 1e-5 (float32 against float64,
sums of at most 80 terms). Then determinism (two runs bitwise equal), and a MoH-wrapped model trained through
token.triton: parameter gradients equal to the reference executor's, and ``fullgraph=True`` capture in train mode.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
import torch
from torch import Tensor

import condcomp
from condcomp.bench.compile import Stack
from condcomp.executors.gathered import CPU, GatheredExecutor, pairs
from condcomp.executors.gathered.pairs import fallback, ops

if pairs.triton_available():
    from condcomp.executors.gathered.pairs import row_launch
else:  # the README's test command installs no triton: the torch fallback runs the same cases
    row_launch = None

INTERPRETER = pairs.interpreting() and pairs.triton_available()
TOL = 1e-5


@pytest.fixture(autouse=True)
def _kernels_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Under the interpreter, a float32 row attention that reached the torch fallback fails the test."""
    if INTERPRETER:
        for name in ("row_attention", "row_attention_backward"):
            original = getattr(fallback, name)

            def refuse(*args: object, _name: str = name, _orig: object = original) -> object:
                if any(isinstance(a, Tensor) and a.dtype == torch.float32 for a in args):
                    raise AssertionError(f"float32 {_name} fell back to torch under the interpreter")
                return _orig(*args)  # type: ignore[operator]

            monkeypatch.setattr(fallback, name, refuse)
    yield


@dataclass
class Rows:
    """One call's arguments: ``q (B, T, R, Dh)``, keys/values ``(B, Hkv, S, Dh)``, a mask, the plan."""

    q: Tensor
    keys: Tensor
    values: Tensor
    mask: Tensor | None
    slot: Tensor
    counts: Tensor
    first: int
    E: int
    G: int
    causal: bool
    scale: float

    def args(self, dtype: torch.dtype, device: str = "cpu") -> tuple:
        m = self.mask
        if m is not None:
            m = m.to(device, dtype if m.is_floating_point() else m.dtype)
        return (self.q.to(device, dtype), self.keys.to(device, dtype), self.values.to(device, dtype), m,
                self.slot.to(device), self.counts.to(device), self.first, self.E, self.G, self.causal, self.scale)


def make(masking: str = "none", B: int = 2, T: int = 6, S: int | None = None, H: int = 6, Hkv: int = 3, first: int = 2,
         R: int = 2, Dh: int = 8, counts: str = "mixed") -> Rows:
    """Tokens with 0 and with R routed heads (R = E: every routed head), distinct slots per token."""
    S = T if S is None else S
    E = H - first
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(B, T, R, Dh, generator=gen, dtype=torch.float64)
    keys = torch.randn(B, Hkv, S, Dh, generator=gen, dtype=torch.float64)
    values = torch.randn(B, Hkv, S, Dh, generator=gen, dtype=torch.float64)
    slot = torch.stack([torch.randperm(E, generator=gen)[:R] for _ in range(B * T)]).view(B, T, R)
    if counts == "none":
        n = torch.zeros(B, T, dtype=torch.long)
    else:
        n = torch.randint(0, R + 1, (B, T), generator=gen)
        n[:, 0] = 0
        if T > 1:
            n[:, 1] = R
    mask: Tensor | None = None
    if masking == "additive":
        mask = torch.randn(B, H, T, S, generator=gen, dtype=torch.float64)
        mask[0, :, 1] = float("-inf")  # a token whose every key is masked: zeros and zero gradients
    elif masking == "padded":
        mask = torch.ones(B, 1, 1, S, dtype=torch.bool)
        mask[1, ..., S - 2:] = False  # padded keys of example 1
    return Rows(q, keys, values, mask, slot, n, first, E, H // Hkv, masking == "causal", Dh**-0.5)


def loop(r: Rows) -> Tensor:
    """float64, one pair at a time: pair (b, t, j < counts) is head ``first + slot``, KV head ``h // G``; a row with
    no allowed key gives zeros."""
    B, T, R, Dh = r.q.shape
    S = r.keys.shape[2]
    rows = []
    for b in range(B):
        for t in range(T):
            for j in range(R):
                if j >= r.counts[b, t]:
                    rows.append(r.q.new_zeros(Dh))
                    continue
                h = r.first + int(r.slot[b, t, j])
                kv = h // r.G
                s = r.keys[b, kv] @ r.q[b, t, j] * r.scale  # (S,)
                allowed = torch.ones(S, dtype=torch.bool)
                if r.causal:
                    allowed &= torch.arange(S) <= t
                if r.mask is not None:
                    m = r.mask[b, min(h, r.mask.shape[1] - 1), min(t, r.mask.shape[2] - 1)]
                    if m.dtype == torch.bool:
                        allowed &= m
                    else:
                        s = s + m
                s = s.masked_fill(~allowed, float("-inf"))
                if not allowed.any() or torch.isinf(s).all():
                    rows.append(r.q.new_zeros(Dh))
                    continue
                rows.append(torch.softmax(s, 0) @ r.values[b, kv])
    return torch.stack(rows).view(B, T, R, Dh)


def reference(r: Rows, probe: Tensor) -> tuple[Tensor, list[Tensor]]:
    leaves = [t.detach().double().requires_grad_() for t in (r.q, r.keys, r.values)]
    rr = copy.copy(r)
    rr.q, rr.keys, rr.values = leaves
    out = loop(rr)
    if not out.requires_grad:  # no selected pair: nothing reads q, keys or values
        return out, [torch.zeros_like(x) for x in leaves]
    grads = torch.autograd.grad((out * probe).sum(), leaves, allow_unused=True)
    return out.detach(), [torch.zeros_like(x) if g is None else g for x, g in zip(leaves, grads, strict=True)]


def op_grads(r: Rows, dtype: torch.dtype, probe: Tensor, device: str = "cpu") -> tuple[Tensor, list[Tensor]]:
    args = list(r.args(dtype, device))
    leaves = [args[i].detach().requires_grad_() for i in range(3)]
    out, lse = ops.pair_row_attention(*leaves, *args[3:])
    assert lse.shape == out.shape[:3] and not lse.requires_grad
    grads = torch.autograd.grad((out * probe.to(out.device, dtype)).sum(), leaves)
    return out.detach().cpu(), [g.cpu() for g in grads]


def check(r: Rows, dtype: torch.dtype = torch.float32, tol: float = TOL, device: str = "cpu") -> None:
    probe = torch.randn(r.q.shape, dtype=torch.float64)
    want, want_g = reference(r, probe)
    got, got_g = op_grads(r, dtype, probe, device)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    for name, g, w in zip(("dq", "dk", "dv"), got_g, want_g, strict=True):
        assert g.shape == w.shape and g.dtype == dtype
        torch.testing.assert_close(g.double(), w, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")


CASES = {
    "plain": {},
    "causal": {"masking": "causal"},
    "additive": {"masking": "additive"},
    "padded_keys": {"masking": "padded"},
    "gqa1": {"Hkv": 6},  # every query head its own KV head
    "gqa_group3_all_routed": {"Hkv": 2, "first": 3, "R": 3},  # G = 3 across the shared/routed boundary, R = E
    "no_shared": {"first": 0, "Hkv": 3, "R": 3, "masking": "causal"},
    "cross": {"S": 11, "masking": "padded"},
    "no_pairs": {"counts": "none"},
}


@pytest.mark.parametrize("case", list(CASES))
def test_row_attention_gradients_match_the_loop(case: str) -> None:
    """float32 (the Triton kernels under the interpreter, else the torch fallback) against the float64 loop."""
    check(make(**CASES[case]))


@pytest.mark.skipif(not (torch.cuda.is_available() and pairs.triton_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_attention_gradients_on_cuda(dtype: torch.dtype) -> None:
    """The compiled kernels (not the interpreter); bfloat16 inputs, float32 sums: tolerance 5e-2."""
    for case in CASES.values():
        check(make(**case), dtype, TOL * 10 if dtype == torch.float32 else 5e-2, "cuda")
    check(make("additive", B=2, T=16, S=80, H=4, Hkv=2, first=1, R=3, Dh=16), dtype,
          TOL * 10 if dtype == torch.float32 else 5e-2, "cuda")


@pytest.mark.parametrize("case", ["plain", "causal", "additive", "padded_keys", "gqa_group3_all_routed"])
def test_fallback_gradcheck(case: str) -> None:
    """The torch fallback's backward (float64: never the kernels) against finite differences."""
    r = make(**{**CASES[case], "T": 4, "Dh": 4})
    args = r.args(torch.float64)

    def fn(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return ops.pair_row_attention(q, k, v, *args[3:])[0]

    leaves = tuple(a.detach().requires_grad_() for a in args[:3])
    assert torch.autograd.gradcheck(fn, leaves)


def test_several_key_blocks_and_row_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """80 keys (two key blocks of 64: two ``dk``/``dv`` programs per KV head, the ``dq`` loop over both) and rows in
    blocks of 16 (several blocks per segment; the ``dk``/``dv`` programs loop over several chunks of rows)."""
    if row_launch is not None:
        monkeypatch.setattr(row_launch, "ROWS", 16)
    check(make("additive", B=2, T=16, S=80, H=4, Hkv=2, first=1, R=3, Dh=16))
    check(make("causal", B=1, T=16, H=3, Hkv=1, first=0, R=3, Dh=16))


def test_a_head_dim_above_one_tile_of_64() -> None:
    """Dh = 80: the whole head dimension in one tile (a tile of 64 would drop the last 16 columns of every dot)."""
    check(make("causal", T=4, Dh=80))


@pytest.mark.parametrize(("B", "T", "S"), [(0, 4, 4), (2, 0, 4), (2, 4, 0)])
def test_empty_batches_sequences_and_keys(B: int, T: int, S: int) -> None:
    """No example, no token, no key: zeros of the right shapes, forward and backward."""
    r = make(B=max(B, 1), T=max(T, 1), S=max(S, 1))
    Dh = r.q.shape[3]
    q = torch.randn(B, T, 2, Dh, requires_grad=True)
    keys, values = (torch.randn(B, 3, S, Dh, requires_grad=True) for _ in range(2))
    slot = torch.zeros(B, T, 2, dtype=torch.long)
    slot[..., 1] = 1
    out, lse = ops.pair_row_attention(q, keys, values, None, slot, torch.ones(B, T, dtype=torch.long), 2, 4, 2,
                                      False, 0.5)
    assert out.shape == q.shape and lse.shape == (B, T, 2) and not out.any()
    out.sum().backward()
    assert q.grad is not None and keys.grad is not None and values.grad is not None
    assert not q.grad.any() and not keys.grad.any() and not values.grad.any()


def test_gradients_are_deterministic() -> None:
    """No atomics: two backward passes give bitwise-equal gradients."""
    r = make("causal", T=12, Hkv=2, first=0, R=3)
    probe = torch.randn(r.q.shape, dtype=torch.float64)
    runs = [op_grads(r, torch.float32, probe)[1] for _ in range(2)]
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_a_mask_that_asks_for_a_gradient_is_an_error() -> None:
    r = make("additive")
    args = list(r.args(torch.float64))
    args[3] = args[3].requires_grad_()
    with pytest.raises(ValueError, match="no gradient flows to the attention mask"):
        ops.pair_row_attention(*args)


@pytest.mark.slow  # about 5 s under the interpreter
def test_backward_op_registration() -> None:
    """``torch.library.opcheck`` (schema, fake tensors, autograd registration) on both ops."""
    r = make("causal", T=4)
    args = r.args(torch.float32)
    torch.library.opcheck(ops.pair_row_attention, args)
    out, lse = ops.pair_row_attention(*args)
    torch.library.opcheck(ops.pair_row_attention_backward, (torch.randn_like(out), *args[:6], out, lse, *args[6:]))


@pytest.fixture
def pairs_executor(restore_registries: None) -> str:
    """``token.triton`` on CPU (the kernels under the interpreter, else the torch fallback) as a registered name."""

    @condcomp.register_executor("pairs_on_cpu")
    class PairsOnCpu(GatheredExecutor):
        def __init__(self) -> None:
            super().__init__(tuning=replace(CPU, static_token=True, pair_kernels_on_cpu=True), strategy="token.triton")

    return "pairs_on_cpu"


def moh_model(executor: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = Stack(32, 4, 2)
    condcomp.apply_(model, condcomp.CondCompConfig(policy="full", router=("moh", {"shared_heads": 1, "top_k": 2}),
                                                   executor=executor))
    return model.train()


def model_grads(model: torch.nn.Module, compile_it: bool) -> tuple[Tensor, dict[str, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    x, mask = torch.randn(3, 7, 32, generator=gen), torch.ones(3, 7, dtype=torch.bool)
    mask[1, 5:] = False
    torch._dynamo.reset()
    run = torch.compile(model, backend="eager", fullgraph=True) if compile_it else model
    y = run(x, mask)
    loss = (y * torch.linspace(-1, 1, y.shape[-1])).sum() + condcomp.aux_loss(model)
    loss.backward()
    return y.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.slow  # dynamo tracing of a two-layer model: 5-10 s
def test_a_moh_model_trains_through_token_triton(pairs_executor: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A MoH-wrapped model in train mode: ``fullgraph=True`` captures it (0 graph breaks), token.triton runs with
    the row attention's backward (not a dense SDPA), and its output and parameter gradients equal the per-head
    reference executor's."""
    calls = []
    for module in (fallback, row_launch) if row_launch is not None else (fallback,):
        original = module.row_attention_backward

        def counted(*args: object, _orig: object = original) -> object:
            calls.append(1)
            return _orig(*args)  # type: ignore[operator]

        monkeypatch.setattr(module, "row_attention_backward", counted)
    model = moh_model(pairs_executor)
    y, got = model_grads(model, compile_it=True)
    assert len(calls) == 2  # one backward per layer
    assert {u.strategy for u in condcomp.head_usage(model).values()} == {"token.triton"}
    want_y, want = model_grads(moh_model("reference"), compile_it=False)
    torch.testing.assert_close(y, want_y, atol=1e-5, rtol=1e-5)
    assert got.keys() == want.keys() and any("router" in n for n in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
