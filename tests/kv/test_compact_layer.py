"""condcomp's compact cache layer (``condcomp.kv.layer.CompactLayer``) without transformers: the ``kv_cache``
executor writes a request's kept groups through it (prefill, then decode steps) and the result equals the per-head
reference loop over the whole sequence (causal, left padding, float64); its row operations act on the plan as on
the keys, and a write of every head into a compact layer is refused."""

from __future__ import annotations

import pytest
import torch
from plain_cache import STEPS, B, Dh, Hkv, Layer, P, reference, request, steps

from condcomp.executors.auto import get_executor
from condcomp.executors.cached import CompactKV
from condcomp.kv.selection import HeldPlan
from condcomp.types import AttentionInputs


def test_the_executor_writes_through_the_layer_and_equals_the_reference_and_rows_follow() -> None:
    r = request()
    w, x, mask, active, plan, sel = r["w"], r["x"], r["mask"], r["active"], r["plan"], r["sel"]
    layer, outs = Layer(), []
    for lo, hi in steps():
        compact = CompactKV(sel, layer.store, None, layer.policy_state(), layer.keep_policy_state)
        inputs = AttentionInputs(x=x[:, lo:hi], mask=mask[:, lo:hi], key_mask=mask[:, :hi])
        with torch.no_grad():
            outs.append(get_executor("kv_cache")(w, inputs, plan, cache=compact))
        layer.condcomp_plan = HeldPlan(plan, sel, Hkv)
    torch.testing.assert_close(torch.cat(outs, 1), reference(r), atol=1e-10, rtol=1e-9)
    kept = int(active.view(B, Hkv, -1).any(-1).sum(-1).max())
    assert layer.inner.keys is not None and layer.inner.keys.shape == (B, kept, P + STEPS, Dh)  # only the kept groups
    assert not sel.identity  # row 0 keeps one group of two: the layer is compact
    with pytest.raises(ValueError, match="holds only"):  # every head written outside the wrapped model
        layer.update(torch.zeros(B, Hkv, 1, Dh), torch.zeros(B, Hkv, 1, Dh))
    layer.batch_select_indices(torch.tensor([2, 0]))
    assert layer.condcomp_plan is not None and torch.equal(layer.condcomp_plan.plan.active, active[[2, 0]])
    layer.reset()
    assert layer.condcomp_plan is None and layer.held_tokens() == 0


def test_a_selections_slot_counts_are_data_that_follow_its_rows_padding_and_pickling() -> None:
    """``slots`` / ``window_slots`` are resolved when a selection is built (a decode step reads them as data): they
    count the index columns (by hand: 3 kept groups of 4, 1 streamed) through row selection, padding, a pickle
    round trip, and a selection pickled before they were data."""
    import pickle

    from condcomp import plan_from_active
    from condcomp.kv.selection import pad_slots, select_kv
    from condcomp.kv.window import StreamWindow
    from condcomp.types import HeadLayout

    layout = HeadLayout(d_model=16, num_heads=8, num_kv_heads=4, head_dim=2, scale=0.5)
    active = torch.tensor([[1, 1, 1, 0, 1, 1, 0, 0], [1, 0, 0, 0, 1, 0, 0, 0]], dtype=torch.bool)  # 3 and 2 groups
    sel = select_kv(plan_from_active(active), layout, StreamWindow(1, 2))
    assert (sel.slots, sel.window_slots) == (3, 2)  # row 1 streams groups 1 and 3
    assert (sel.kv_index.shape[1], sel.window_index is not None and sel.window_index.shape[1]) == (3, 2)
    assert (pad_slots(sel, 4).slots, pad_slots(sel, 4).window_slots) == (4, 2)
    held = HeldPlan(plan_from_active(active), sel, 4).take_rows(torch.tensor([0]))
    assert held.selection is not None and (held.selection.slots, held.selection.window_slots) == (3, 2)
    again = pickle.loads(pickle.dumps(sel))
    assert (again.slots, again.window_slots) == (3, 2) and torch.equal(again.kv_index, sel.kv_index)
    older = {k: v for k, v in vars(sel).items() if k not in ("slots", "window_slots")}  # pickled before
    revived = object.__new__(type(sel))
    revived.__setstate__(older)
    assert (revived.slots, revived.window_slots) == (3, 2)
