"""The preallocated states of fixed-slot KV policies (``condcomp.kv.fixed_slots``) against hand counts: which slot
a position goes to, which position each ring slot holds, the valid slots ``[0, length)``, in-place writes, crop and
row operations. The decode paths through a static cache are ``tests/integrations/hf/test_compiled_kv_policies.py``."""

from __future__ import annotations

import pytest
import torch

from condcomp.kv.fixed_slots import RingWindow, SlotRegion, ring_slot
from condcomp.kv.window import StreamWindow, WindowCache

WINDOW = StreamWindow(sinks=1, window=3)


def _ring(seen: list[int], room: int = 16) -> RingWindow:
    """A ring made from a window cache holding positions 0..seen-1 of each row (key value = position + 1)."""
    B, N = len(seen), max(seen)
    pos = torch.tensor([[p if p < s else -1 for p in range(N)] for s in seen])  # (B, N)
    keys = (pos + 1).float().clamp_min(0)[:, None, :, None].expand(B, 2, N, 4).contiguous()  # (B, gw=2, N, Dh=4)
    return RingWindow.from_cache(WindowCache(keys, keys.clone(), pos, torch.tensor(seen)), WINDOW, room)


def test_ring_slots_and_the_positions_they_hold_by_hand() -> None:
    assert ring_slot(torch.arange(9), 1, 3).tolist() == [0, 1, 2, 3, 1, 2, 3, 1, 2]
    ring = _ring([7, 3])
    # row 0 after 7 tokens: slot 0 the sink, slots 1..3 the latest positions = 1 mod 3, 2 mod 3, 0 mod 3: 4, 5, 6
    assert ring.slot_positions().tolist() == [[0, 4, 5, 6], [0, 1, 2, -1]]
    assert ring.length.tolist() == [[4, 4], [3, 3]]
    assert ring.keys[0, 0, :, 0].tolist() == [1.0, 5.0, 6.0, 7.0]  # the keys of positions 0, 4, 5, 6
    assert ring.keys[1, 1, :3, 0].tolist() == [1.0, 2.0, 3.0]


def test_a_ring_for_a_short_request_never_wraps() -> None:
    ring = _ring([2], room=1)  # at most 3 tokens ever: 3 slots, not sinks + window = 4
    assert tuple(ring.keys.shape) == (1, 2, 3, 4)


def test_one_token_is_written_in_place_and_the_counts_advance() -> None:
    ring = _ring([7, 3])
    keys = ring.keys
    q = torch.zeros(2, 4, 1, 4)  # gw=2 groups x r=2 query heads
    new = torch.full((2, 2, 1, 4), 9.0)
    _, dead = ring.attend(q, new, new.clone(), None, 1.0, WINDOW)
    assert ring.keys is keys and not bool(dead.any())
    # row 0's position 7 goes to slot 1 (over position 4); row 1's position 3 to slot 3
    assert ring.keys[0, 0, :, 0].tolist() == [1.0, 9.0, 6.0, 7.0] and ring.keys[1, 0, 3, 0].item() == 9.0
    assert ring.seen.tolist() == [8, 4] and ring.length.tolist() == [[4, 4], [4, 4]]


def test_ring_crop_takes_one_token_back_and_refuses_what_it_overwrote() -> None:
    ring = _ring([7, 3])
    ring.crop(1, WINDOW)
    assert ring.seen.tolist() == [6, 2] and ring.length.tolist() == [[4, 4], [2, 2]]
    with pytest.raises(ValueError, match=r"overwrote tokens the next query would read in row\(s\) \[0\]"):
        _ring([7, 3]).crop(2, WINDOW)
    short = _ring([3, 2])  # never wrapped: any crop keeps what the next query reads
    short.crop(2, WINDOW)
    assert short.seen.tolist() == [1, 0] and short.length.tolist() == [[1, 1], [0, 0]]


def test_rows_are_permuted_in_place_and_selected_as_new_storage() -> None:
    ring = _ring([7, 3])
    keys = ring.keys
    assert ring.take_rows(torch.tensor([1, 1])) is ring and ring.keys is keys
    assert ring.seen.tolist() == [3, 3] and ring.keys[0, 0, :3, 0].tolist() == [1.0, 2.0, 3.0]
    picked = ring.take_rows(torch.tensor([True, False]))
    assert picked.keys is not keys and tuple(picked.keys.shape) == (1, 2, 4, 4)


def test_a_region_keeps_each_groups_selection_first_then_appends_at_its_length() -> None:
    positions = torch.tensor([[[0, -1, 2], [-1, 1, -1]]])  # (B=1, gw=2, n=3): 2 and 1 tokens selected
    keys = (positions + 1).float().clamp_min(0)[..., None].expand(1, 2, 3, 4).contiguous()
    region = SlotRegion.from_state(keys, keys.clone(), positions, torch.tensor([5]), torch.tensor([5]), 2, False)
    assert tuple(region.keys.shape) == (1, 2, 5, 4) and region.length.tolist() == [[2, 1]]
    assert region.keys[0, 0, :2, 0].tolist() == [1.0, 3.0] and region.keys[0, 1, 0, 0].item() == 2.0
    new = torch.full((1, 2, 1, 4), 9.0)
    region.attend(torch.zeros(1, 2, 1, 4), new, new.clone(), None, 1.0)
    assert region.length.tolist() == [[3, 2]] and region.seen.tolist() == [6]
    assert region.keys[0, 0, 2, 0].item() == 9.0 and region.keys[0, 1, 1, 0].item() == 9.0
    region.crop(1)
    assert region.length.tolist() == [[2, 1]] and region.seen.tolist() == [5]
