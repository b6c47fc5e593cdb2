"""``condcomp.kv.kernels.compact_decode_attention`` against a float64 loop over (request, slot, query head) that
reads a slot's keys ``[0, length)`` plus the bias, written out by hand: full and ragged lengths, length-0 slots (the
output is defined: zeros), a slot whose every key's bias is ``-inf`` (zeros too), GQA through a kept-group index with
spare slots, several key blocks and splits (the reduce kernel) and one split (no reduce).

Plain runs exercise the torch fallback; with ``TRITON_INTERPRET=1`` set before the process starts (the CI step in
``.ci/run``) the same tests run the Triton kernels on CPU in float32, and the fallback is patched to fail for float32
so that nothing passes by falling back. ``opcheck`` checks the registration (schema, fake tensor), and
``torch.compile(fullgraph=True, backend="eager")`` captures the op. On a machine with CUDA, ``test_kernels_on_cuda``
runs the compiled kernels in float32, bfloat16 and float16.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch import Tensor

from condcomp.executors.gathered import pairs
from condcomp.kv.kernels import compact_decode_attention, fallback, tiling

INTERPRETER = pairs.interpreting() and pairs.triton_available()
ATOL, RTOL = 1e-5, 1e-5  # float32 against the float64 loop


@pytest.fixture(autouse=True)
def _kernels_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Under the interpreter, a float32 call that reached the torch fallback fails the test."""
    if INTERPRETER:
        original = fallback.decode_attention

        def refuse(q: Tensor, *args: object) -> Tensor:
            if q.dtype == torch.float32:
                raise AssertionError("a float32 decode attention fell back to torch under the interpreter")
            return original(q, *args)  # type: ignore[arg-type]

        monkeypatch.setattr(fallback, "decode_attention", refuse)
    yield


def loop(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float, kv_index: Tensor | None, R: int,
         bias: Tensor | None) -> Tensor:
    """The rule in float64, one (request, slot, query head) at a time."""
    B, G, S, Dh = k.shape
    out = torch.zeros(B, G * R, 1, Dh, dtype=torch.float64)
    for b in range(B):
        for g in range(G):
            group = g if kv_index is None else int(kv_index[b, g])
            n = min(max(int(lengths[b, g]), 0), S)
            for j in range(R):
                query = q[b, group * R + j, 0].double()
                scores = [float(query @ k[b, g, s].double()) * scale + (0.0 if bias is None else float(bias[b, s]))
                          for s in range(n)]
                readable = [s for s in range(n) if scores[s] != -math.inf]
                if not readable:
                    continue  # no key to read: zeros
                top = max(scores[s] for s in readable)
                weights = {s: math.exp(scores[s] - top) for s in readable}
                total = sum(weights.values())
                out[b, g * R + j, 0] = sum(w / total * v[b, g, s].double() for s, w in weights.items())
    return out


def inputs(B: int, Hq: int, G: int, S: int, Dh: int, dtype: torch.dtype = torch.float32,
           device: str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(B * 1000 + S)
    shape = (B, G, S, Dh)
    q = torch.randn(B, Hq, 1, Dh, generator=g)
    return (q.to(device, dtype), torch.randn(shape, generator=g).to(device, dtype),
            torch.randn(shape, generator=g).to(device, dtype))


CASES = {  # name: (B, Hq, G, S, Dh, lengths, kv_index, R, block_n, split_n)
    "full lengths, one split": (2, 4, 2, 40, 8, [[40, 40], [40, 40]], None, 2, 16, 64),
    "ragged lengths, several splits": (3, 2, 2, 100, 8, [[100, 37], [1, 64], [65, 16]], None, 1, 16, 32),
    "length 0 and past S": (2, 6, 3, 50, 16, [[0, 50, 9], [0, 0, 200]], None, 2, 16, 16),
    "GQA through kv_index, spare slots": (2, 8, 3, 70, 8, [[70, 23, 0], [48, 0, 0]], [[3, 0, 3], [1, 1, 1]], 2, 16,
                                          32),
    "head width not a power of two": (1, 3, 1, 33, 12, [[33]], None, 3, 16, 16),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_float64_loop(name: str) -> None:
    B, Hq, G, S, Dh, lengths, index, R, block_n, split_n = CASES[name]
    q, k, v = inputs(B, Hq, G, S, Dh)
    lens = torch.tensor(lengths, dtype=torch.int32)
    kv_index = None if index is None else torch.tensor(index)
    y = compact_decode_attention(q, k, v, lens, 0.3, kv_index=kv_index, group_size=R, block_n=block_n,
                                 split_n=split_n)
    assert y.shape == (B, G * R, 1, Dh) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), loop(q, k, v, lens, 0.3, kv_index, R, None), atol=ATOL, rtol=RTOL)


def test_the_default_tiling_matches_the_float64_loop() -> None:
    """64-key blocks, one split per block here (5 splits and the reduce), GQA through kv_index."""
    q, k, v = inputs(2, 8, 2, 300, 16)
    lens = torch.tensor([[300, 129], [64, 0]], dtype=torch.int32)
    index = torch.tensor([[2, 0], [3, 3]])
    assert tiling(2, 2, 300) == (64, 64)
    y = compact_decode_attention(q, k, v, lens, 0.2, kv_index=index, group_size=2)
    torch.testing.assert_close(y.double(), loop(q, k, v, lens, 0.2, index, 2, None), atol=ATOL, rtol=RTOL)


def test_zero_length_slots_output_exact_zeros_and_others_do_not() -> None:
    q, k, v = inputs(2, 2, 2, 30, 8)
    lens = torch.tensor([[0, 30], [12, 0]], dtype=torch.int32)
    y = compact_decode_attention(q, k, v, lens, 1.0, block_n=16, split_n=16)
    assert torch.equal(y[0, 0], torch.zeros_like(y[0, 0])) and torch.equal(y[1, 1], torch.zeros_like(y[1, 1]))
    assert y[0, 1].abs().sum() > 0 and y[1, 0].abs().sum() > 0


@pytest.mark.parametrize("split_n", [16, 128])
def test_a_bias_masks_keys_and_a_row_with_every_key_masked_is_zero(split_n: int) -> None:
    B, G, S = 3, 2, 60
    q, k, v = inputs(B, 4, G, S, 8)
    bias = torch.randn(B, S) * 0.5
    bias[0, :20] = -math.inf  # left padding
    bias[1, 5:45] = -math.inf  # masked keys inside a split
    bias[2] = -math.inf  # every key masked
    lens = torch.tensor([[60, 33], [50, 60], [60, 60]], dtype=torch.int32)
    y = compact_decode_attention(q, k, v, lens, 0.25, bias=bias, block_n=16, split_n=split_n)
    torch.testing.assert_close(y.double(), loop(q, k, v, lens, 0.25, None, 2, bias), atol=ATOL, rtol=RTOL)
    assert torch.equal(y[2], torch.zeros_like(y[2])) and bool(torch.isfinite(y).all())


@pytest.mark.parametrize("split_n", [16, 128])
def test_a_nan_read_gives_nan_as_sdpa_and_a_nan_past_the_length_is_not_read(split_n: int) -> None:
    # the kernels turned a NaN query into zeros (sum NaN is not > 0: the "no key" branch), where SDPA and the
    # float64 rule give NaN; the fallback read a NaN value past the length (0 * NaN) where the kernels do not
    B, G, S = 3, 2, 60
    q, k, v = inputs(B, 4, G, S, 8)
    lens = torch.tensor([[60, 60], [40, 60], [60, 20]], dtype=torch.int32)
    q[0, 1, 0, 3] = math.nan  # query head 1 of request 0 (slot 0's second head)
    k[1, 0, 7, 2] = math.nan  # read by request 1's slot 0 (length 40)
    v[1, 1, 59, :] = math.nan  # read by request 1's slot 1 (length 60)
    k[2, 1, 30, :] = math.nan  # past request 2's slot 1 length (20): never read
    v[2, 1, 45, :] = math.nan
    y = compact_decode_attention(q, k, v, lens, 0.25, block_n=16, split_n=split_n)  # (B, 4, 1, 8)
    nan_rows = {(0, 1), (1, 0), (1, 1), (1, 2), (1, 3)}  # (request, output row): rows 2g, 2g + 1 read slot g
    for b in range(B):
        for r in range(4):
            assert bool(y[b, r].isnan().all()) == ((b, r) in nan_rows), (b, r, y[b, r])
    clean = [(b, r) for b in range(B) for r in range(4) if (b, r) not in nan_rows]
    want = loop(q.nan_to_num(), k.nan_to_num(), v.nan_to_num(), lens, 0.25, None, 2, None)
    for b, r in clean:
        torch.testing.assert_close(y[b, r].double(), want[b, r], atol=ATOL, rtol=RTOL)


def test_a_broadcast_bias_and_strided_pools_are_read_in_place() -> None:
    """A bias expanded over the batch (stride 0) and pools that are views of a larger storage (a static layer's)."""
    q, k_big, v_big = inputs(2, 4, 3, 48, 8)
    k, v = k_big[:, 1:], v_big[:, 1:]  # (2, 2, 48, 8) views
    bias = torch.zeros(1, 48).masked_fill(torch.arange(48) >= 40, -math.inf).expand(2, 48)
    lens = torch.tensor([[48, 30], [7, 48]], dtype=torch.int32)
    y = compact_decode_attention(q, k, v, lens, 0.5, bias=bias, block_n=16, split_n=16)
    torch.testing.assert_close(y.double(), loop(q, k, v, lens, 0.5, None, 2, bias), atol=ATOL, rtol=RTOL)


def test_the_tiling_is_from_shapes_and_whole_blocks() -> None:
    assert tiling(32, 1, 4096) == (64, 256)  # 32 requests x 16 splits = 512 programs
    assert tiling(1, 1, 10) == (16, 16)  # a short pool: one block of at least 16 keys
    block_n, split_n = tiling(4, 3, 1000)
    assert block_n == 64 and split_n % block_n == 0 and split_n * math.ceil(1000 / split_n) >= 1000


def test_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    if INTERPRETER:
        pytest.skip("Triton 3.9's interpreter reads bfloat16 tensors wrongly (a tl.dot of bfloat16 tiles differs "
                    "from torch by about 1e10): bfloat16 runs the kernels only on CUDA (test_kernels_on_cuda)")
    q, k, v = inputs(2, 4, 2, 40, 16, torch.bfloat16)
    lens = torch.tensor([[40, 17], [0, 33]], dtype=torch.int32)
    y = compact_decode_attention(q, k, v, lens, 0.25, block_n=16, split_n=16)  # the torch fallback on CPU
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), loop(q, k, v, lens, 0.25, None, 2, None), atol=2e-2, rtol=2e-2)


def test_wrong_inputs_are_named() -> None:
    q, k, v = inputs(2, 4, 2, 20, 8)
    lens = torch.full((2, 2), 20, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"q must be \(B, Hq, 1, Dh\)"):
        compact_decode_attention(q.expand(2, 4, 3, 8), k, v, lens, 1.0)
    with pytest.raises(ValueError, match="lengths must be int32 or int64"):
        compact_decode_attention(q, k, v, lens.float(), 1.0)
    with pytest.raises(ValueError, match="with kv_index, pass group_size"):
        compact_decode_attention(q, k, v, lens, 1.0, kv_index=torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="group_size 3 does not fit"):
        compact_decode_attention(q, k, v, lens, 1.0, group_size=3)
    with pytest.raises(ValueError, match=r"bias must be floating point \(B, S\)"):
        compact_decode_attention(q, k, v, lens, 1.0, bias=torch.zeros(2, 19))
    with pytest.raises(TypeError, match="share one floating dtype"):
        compact_decode_attention(q, k.double(), v, lens, 1.0)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        compact_decode_attention(q, k, v, lens, 1.0, block_n=24, split_n=48)


@pytest.mark.parametrize("bad", [4, -1])
def test_a_kv_index_outside_the_models_groups_is_refused_by_name(bad: int) -> None:
    """Hq = 8 query heads, group_size 2: the model has 4 groups; a slot naming group 4 (or -1) would be read by
    another request's query heads in the kernel: refused on CPU (kernels under the interpreter, or the fallback),
    eager and compiled, naming the value, where it is and the range."""
    q, k, v = inputs(2, 8, 2, 20, 8)
    lens = torch.full((2, 2), 20, dtype=torch.int32)
    index = torch.tensor([[3, 0], [1, bad]])
    match = rf"kv_index holds \[{bad}\] at \(request, slot\) \[\[1, 1\]\], outside the model's 4 key/value groups"
    with pytest.raises(ValueError, match=match):
        compact_decode_attention(q, k, v, lens, 1.0, kv_index=index, group_size=2)
    torch._dynamo.reset()
    step = torch.compile(lambda: compact_decode_attention(q, k, v, lens, 1.0, kv_index=index, group_size=2),
                         backend="eager", fullgraph=True)
    with pytest.raises(ValueError, match=match):
        step()
    index[1, 1] = 2  # in range: the float64 rule
    torch.testing.assert_close(compact_decode_attention(q, k, v, lens, 1.0, kv_index=index, group_size=2).double(),
                               loop(q, k, v, lens, 1.0, index, 2, None), atol=ATOL, rtol=RTOL)


def test_off_the_host_a_bad_kv_index_trips_a_device_assert_and_the_compact_cache_skips_the_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where reading the index back would sync (a GPU), the check is ``torch._assert_async`` (captured by CUDA graphs):
    run here on CPU tensors it raises at once with the same range and advice. The compact cache's own calls pass
    ``check_index=False`` (its index is built in range): no check, so no extra launch per layer and step."""
    from condcomp.kv.kernels import compact, ops

    q, _, _ = inputs(2, 8, 2, 20, 8)
    with pytest.raises(RuntimeError, match=r"kv_index holds a value outside the model's 4 key/value groups \[0, 4\)"):
        ops._check_index_values(q, torch.tensor([[3, 0], [1, 4]]), 2, on_host=False)
    ops._check_index_values(q, torch.tensor([[3, 0], [1, 2]]), 2, on_host=False)  # in range: nothing raised
    checked: list[object] = []
    monkeypatch.setattr(ops, "_check_index_values", lambda *a, **kw: checked.append(a))
    q, k, v = inputs(2, 8, 2, 20, 8)
    lens = torch.full((2, 2), 20, dtype=torch.int32)
    compact_decode_attention(q, k, v, lens, 1.0, kv_index=torch.tensor([[3, 0], [1, 2]]), group_size=2)
    assert len(checked) == 1  # a caller's index is checked
    sel = type("Sel", (), {"kv_index": torch.tensor([[3, 0], [1, 2]]), "slot_gates": torch.ones(2, 4)})()
    mask = type("Mask", (), {"mask": None})()
    compact.compact_decode(q, k, v, mask, sel, torch.tensor(20), 2, 1.0)  # type: ignore[arg-type]
    assert len(checked) == 1  # the compact cache's is not


def _opcheck_args() -> list[tuple[object, ...]]:
    q, k, v = inputs(2, 4, 2, 40, 8)
    lens = torch.tensor([[40, 3], [0, 21]], dtype=torch.int32)
    bias = torch.zeros(2, 40)
    bias[0, :5] = -math.inf
    index = torch.tensor([[1, 0], [1, 1]])
    return [(q, k, v, lens, 0.5, None, 2, None, 16, 16), (q, k, v, lens, 0.5, index, 2, bias, 16, 32)]


@pytest.mark.parametrize("case", [0, 1])
def test_opcheck(case: int) -> None:
    torch.library.opcheck(torch.ops.condcomp.compact_decode_attention.default, _opcheck_args()[case],
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_compile_captures_it_with_no_graph_break() -> None:
    q, k, v = inputs(2, 8, 3, 50, 8)
    lens = torch.tensor([[50, 9, 0], [31, 50, 2]], dtype=torch.int32)
    index = torch.tensor([[0, 2, 0], [3, 1, 2]])

    def step(q: Tensor, lens: Tensor) -> Tensor:
        return compact_decode_attention(q, k, v, lens, 0.3, kv_index=index, group_size=2, block_n=16, split_n=16)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, lens).double(), loop(q, k, v, lens, 0.3, index, 2, None), atol=ATOL,
                               rtol=RTOL)
    grown = lens + torch.tensor([[0, 1, 0], [1, 0, 1]], dtype=torch.int32)  # a later step: new values, same graph
    torch.testing.assert_close(compiled(q, grown).double(), loop(q, k, v, grown, 0.3, index, 2, None), atol=ATOL,
                               rtol=RTOL)


@pytest.mark.skipif(not pairs.interpreting(), reason="needs TRITON_INTERPRET=1 set before the process starts")
def test_the_kernels_run_under_the_interpreter() -> None:
    assert INTERPRETER, "TRITON_INTERPRET=1 but triton is not installed (pip install -e '.[gpu]')"
    assert pairs.kernel_runs(torch.zeros(1))


@pytest.mark.skipif(not (torch.cuda.is_available() and pairs.triton_available()), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernels_on_cuda(dtype: torch.dtype) -> None:
    """The compiled kernels with the default tiling (several splits) and one split, GQA through kv_index."""
    B, G, S, Dh, R = 4, 3, 1000, 64, 3
    q, k, v = inputs(B, 4 * R, G, S, Dh, dtype, "cuda")
    lens = torch.tensor([[1000, 517, 0], [1, 64, 999], [0, 0, 0], [300, 300, 2000]], dtype=torch.int32)
    index = torch.tensor([[3, 1, 3], [0, 1, 2], [0, 0, 0], [2, 3, 0]])
    bias = torch.zeros(B, S)
    bias[1, :10] = -math.inf
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    want = loop(q.cpu(), k.cpu(), v.cpu(), lens, 0.125, index, R, bias)
    for split_n in (None, 1024):
        y = compact_decode_attention(q, k, v, lens.cuda(), 0.125, kv_index=index.cuda(), group_size=R,
                                     bias=bias.cuda(), split_n=split_n)
        torch.testing.assert_close(y.double().cpu(), want, **tol)  # type: ignore[arg-type]
