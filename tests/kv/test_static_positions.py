"""condcomp.kv.static: where a call's tokens go in preallocated storage, read from a device count, against rules
written out by hand (loops over positions)."""

from __future__ import annotations

import pytest
import torch

from condcomp.kv.static import query_positions, query_rows, written_bias


@pytest.mark.parametrize("held,T", [(0, 1), (0, 5), (3, 1), (7, 2)])
def test_written_bias_lets_each_query_read_only_the_positions_written_up_to_it(held: int, T: int) -> None:
    S = 10
    bias = written_bias(torch.tensor(held), T, S, torch.float64)
    assert bias.shape == (1, 1, T, S)
    for i in range(T):
        for j in range(S):
            assert bias[0, 0, i, j].item() == (0.0 if j <= held + i else float("-inf")), (i, j)


def test_written_bias_within_a_window_reads_only_the_last_window_positions() -> None:
    held, T, S, window = 5, 2, 9, 3
    bias = written_bias(torch.tensor(held), T, S, torch.float32, window)
    for i in range(T):
        want = [held + i - window < j <= held + i for j in range(S)]
        assert [b == 0.0 for b in bias[0, 0, i].tolist()] == want


def test_query_rows_reads_each_row_at_the_call_positions() -> None:
    key_ok = torch.tensor([[False, True, True, False, True, True],
                           [True, True, False, True, False, True]])
    got = query_rows(key_ok, torch.tensor(2), 3)
    assert got.tolist() == [[key_ok[b, 2 + i].item() for i in range(3)] for b in range(2)]
    assert query_positions(torch.tensor(4), 2).tolist() == [4, 5]


def test_nothing_is_read_back_to_the_host_under_torch_compile() -> None:
    def f(held: torch.Tensor, key_ok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return written_bias(held, 1, 6, torch.float32), query_rows(key_ok, held, 1)

    compiled = torch.compile(f, backend="eager", fullgraph=True)  # a host read would be a graph break: an error
    key_ok = torch.ones(2, 6, dtype=torch.bool)
    for held in range(3):
        want = f(torch.tensor(held), key_ok)
        got = compiled(torch.tensor(held), key_ok)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
