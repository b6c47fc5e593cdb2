"""Decoding as an ordinary executor call: a call on a compact KV cache carries it in ``AttentionInputs.kv_cache``,
``resolve_executor``/``explain`` pick ``kv_cache`` for it and say why, a named executor that cannot read the cache is
replaced on those calls with one warning naming the fix, and the usage record is the executor's."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor

import condcomp
from condcomp.executors.auto import Notices, resolve_executor
from condcomp.executors.cached import CachedRun, CompactKV
from condcomp.kv import select_kv
from condcomp.types import AttentionInputs

t = pytest.importorskip("transformers")


class ListCache:
    def __init__(self) -> None:
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def store(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], 2)
        self.v = v if self.v is None else torch.cat([self.v, v], 2)
        return self.k, self.v


def cached_call() -> tuple[condcomp.AttentionWeights, AttentionInputs, condcomp.HeadPlan]:
    torch.manual_seed(0)
    attn = condcomp.HeadAttention(16, 4, num_kv_heads=2, causal=True)
    plan = condcomp.plan_from_active(torch.tensor([[True, True, False, False], [False, False, True, True]]))
    compact = CompactKV(select_kv(plan, attn.layout), ListCache().store)
    return attn.weights(), AttentionInputs(x=torch.randn(2, 3, 16), kv_cache=compact), plan


def test_auto_and_explain_pick_kv_cache_on_a_cached_call_and_say_why_the_others_cannot() -> None:
    w, inputs, plan = cached_call()
    choice = condcomp.explain(w, inputs, plan)
    assert choice.executor == "kv_cache" and isinstance(choice.run, CachedRun)
    verdicts = dict(choice.verdicts)
    assert "compact KV cache" in verdicts["gathered"] and "compact KV cache" in verdicts["masked"]
    assert "only this executor" in verdicts["kv_cache"]
    # the same plan without a cache: the cache-free executors compete again
    assert condcomp.explain(w, AttentionInputs(x=inputs.x), plan).executor != "kv_cache"


def test_a_named_executor_that_cannot_read_the_cache_is_replaced_with_one_warning_naming_the_fix() -> None:
    w, inputs, plan = cached_call()
    notices = Notices()  # what a wrapped model's layers share: the warnings already given
    with pytest.warns(UserWarning, match="'gathered' cannot read .*use_cache=False"):
        run = resolve_executor("gathered", w, inputs, plan, notices=notices)
    assert run.name == "kv_cache"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per executor, not per call
        assert resolve_executor("gathered", w, inputs, plan, notices=notices).name == "kv_cache"
    with pytest.warns(UserWarning, match="'gathered' cannot read"):  # other notices (another model): told again
        resolve_executor("gathered", w, inputs, plan, notices=Notices())
    choice = condcomp.explain(w, inputs, plan, executor="gathered")
    assert choice.executor == "kv_cache" and "use_cache=False" in dict(choice.verdicts)["gathered"]


@pytest.mark.parametrize("executor", ["auto", "gathered"])
@pytest.mark.parametrize("model_number", [1, 2])  # the warning is the model's: a second model is told too
def test_a_wrapped_llama_decodes_through_kv_cache_and_records_it(executor: str, model_number: int) -> None:
    model = wrapped_llama(executor)
    ids = torch.randint(1, 50, (2, 5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    replaced = [w for w in caught if "cannot read a decoder request's compact KV cache" in str(w.message)]
    assert len(replaced) == (1 if executor == "gathered" else 0)  # one warning for the whole generation
    usage = condcomp.head_usage(model)
    assert {u.executor for u in usage.values()} == {"kv_cache"}
    assert {u.strategy for u in usage.values()} <= {"compact", "full"}


def wrapped_llama(executor: str = "auto") -> t.LlamaForCausalLM:
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=50)
    model = t.LlamaForCausalLM(config).eval()
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), executor=executor,
                                                   router=("topk", {"kv_groups": True})))
    return model


def test_a_request_holds_the_executor_its_first_call_resolved_until_its_cache_is_reset() -> None:
    model, ids = wrapped_llama(), torch.randint(1, 50, (2, 5))
    cache = t.DynamicCache(config=model.config)
    model.generate(input_ids=ids, max_new_tokens=3, do_sample=False, pad_token_id=0, past_key_values=cache)
    # by name: another test's registration (restore_registries) may have replaced the shared instance since
    assert [getattr(layer.condcomp_executor, "name", None) for layer in cache.layers] == ["kv_cache", "kv_cache"]
    cache.reset()  # the next call is a new request's first: its executor is resolved again
    assert [layer.condcomp_executor for layer in cache.layers] == [None, None]


def test_a_cache_reader_without_attend_is_resolved_and_asked_for_its_record_at_every_call(
        restore_registries: None) -> None:
    """The executor protocol before ``attend``: a registered cache reader with only ``supports``, ``estimate`` and
    ``__call__`` (cheaper than kv_cache, so auto picks it) runs every call of every layer (counted by hand: the
    prefill and each decode step), with kv_cache's tokens (it computes with kv_cache's call), and is what
    head_usage names."""
    from condcomp.protocols import Capabilities, Estimate
    from condcomp.registry import register_executor

    ids = torch.randint(1, 50, (2, 5))
    want = wrapped_llama().generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    calls = []

    @register_executor("older_reader")
    class OlderReader:
        name = "older_reader"
        capabilities = Capabilities(reads_kv_cache=True)

        def supports(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            return None

        def estimate(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            return Estimate(-1.0)

        def __call__(self, weights, inputs, plan):  # noqa: ANN001, ANN201
            calls.append(inputs.x.shape[1])
            return condcomp.get_executor("kv_cache")(weights, inputs, plan)

    model = wrapped_llama()
    got = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    assert calls == [5, 5] + [1, 1] * 3  # 2 layers: the prefill, then 3 decode steps
    assert {(u.executor, u.strategy) for u in condcomp.head_usage(model).values()} == {("older_reader", None)}
