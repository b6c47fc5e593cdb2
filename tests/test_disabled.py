"""``condcomp.disabled(model)``: inside the block the wrapped model computes exactly what the original does.

Reference: the unwrapped module (a deep copy taken before ``apply_``), with the same casts and adapters applied.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

import condcomp

CFG = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="topk", executor="gathered")


@pytest.mark.parametrize("kind", ["head_attention", "torch_mha"])
def test_disabled_runs_the_original_exactly_and_then_routes_again(kind: str) -> None:
    torch.manual_seed(0)
    if kind == "head_attention":
        model: nn.Module = nn.Sequential(condcomp.HeadAttention(32, 4))
    else:
        model = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    ref = copy.deepcopy(model).eval()
    condcomp.apply_(model, CFG)
    model.eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        routed = model(x)
        with condcomp.disabled(model):
            torch.testing.assert_close(model(x), ref(x), atol=0, rtol=0)
        assert not torch.allclose(routed, ref(x))  # half the heads: the routed output differs
        torch.testing.assert_close(model(x), routed, atol=0, rtol=0)
        model.double()  # a cast after apply_ reaches the original module too
        ref.double()
        with condcomp.disabled(model):
            torch.testing.assert_close(model(x.double()), ref(x.double()), atol=0, rtol=0)


def test_disabled_sees_projections_replaced_after_apply() -> None:
    """A projection swapped in after apply_ (as PEFT does) is what the original module runs inside the block."""
    torch.manual_seed(0)
    model = nn.Sequential(condcomp.HeadAttention(16, 2))
    condcomp.apply_(model, CFG)
    new_q = nn.Linear(16, 16)
    model[0].q_proj = new_q
    ref = nn.Sequential(condcomp.HeadAttention(16, 2))
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if "condcomp" not in k})
    x = torch.randn(2, 3, 16)
    with torch.no_grad(), condcomp.disabled(model):
        torch.testing.assert_close(model(x), ref(x), atol=0, rtol=0)


def test_disabled_needs_routing() -> None:
    with pytest.raises(ValueError, match="no condcomp routing"):
        with condcomp.disabled(nn.Linear(2, 2)):
            pass


@pytest.mark.slow
def test_disabled_on_transformers_models_both_paths() -> None:
    transformers = pytest.importorskip("transformers")
    from condcomp.integrations.hf.interface import apply_interface_

    cfg = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37,
                                   num_key_value_heads=2, vocab_size=100, attn_implementation="sdpa")
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (2, 6))
    with torch.no_grad():
        want = ref(input_ids=ids).logits
        for attach in (condcomp.apply_, apply_interface_):
            model = copy.deepcopy(ref)
            attach(model, CFG)
            with condcomp.disabled(model):
                torch.testing.assert_close(model(input_ids=ids).logits, want, atol=0, rtol=0)
            assert not torch.allclose(model(input_ids=ids).logits, want)


def test_blocks_nest_in_one_thread_and_another_threads_overlapping_block_is_refused() -> None:
    """The blocks set the model's state for every thread: one opened by a second thread while the first is inside
    one is refused (interleaved, each block's exit would restore the other thread's setting for good)."""
    torch.manual_seed(0)
    model = nn.Sequential(condcomp.HeadAttention(32, 4))
    ref = copy.deepcopy(model).eval()
    condcomp.apply_(model, CFG)
    model.eval()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        with condcomp.budget(model, 0.25), condcomp.budget(model, 1.0):  # nested in one thread: the inner wins
            torch.testing.assert_close(model(x), ref(x))
        inside, refused, leave = threading.Event(), [], threading.Event()

        def hold() -> None:
            with condcomp.budget(model, 0.25):
                inside.set()
                leave.wait(30)

        holder = threading.Thread(target=hold)
        holder.start()
        inside.wait(30)
        try:
            with condcomp.budget(model, 1.0):
                pass
        except RuntimeError as e:
            refused.append(str(e))
        finally:
            leave.set()
            holder.join()
        assert refused and "another thread" in refused[0]
        with condcomp.disabled(model):  # both blocks ended: nothing left set, a new block works
            torch.testing.assert_close(model(x), ref(x), atol=0, rtol=0)
        assert not torch.allclose(model(x), ref(x))  # the wrap's own budget (half the heads) again
        assert all(h.budget_fraction is None for h in condcomp.api.routing_hosts(model).values())
