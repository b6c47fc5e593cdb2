"""A KV policy that keeps the groups a plan does not keep is refused at attach time where the adapter cannot hold
it (T5's decoder for a policy that cannot add its position bias, the attention-function attachment): those used to cache
every head and silently drop the groups (red team round 4, items 1-2). ``kv="drop"`` (the default) still attaches.
Layers that hold no request's growing cache (cross-attention, an encoder) refuse such a policy at their first call."""

from __future__ import annotations

import warnings

import pytest
import torch

import condcomp

t = pytest.importorskip("transformers")

T5_DECODER_SELF = r"re:decoder\.block\.\d+\.layer\.0\.SelfAttention"


def t5() -> torch.nn.Module:
    torch.manual_seed(0)
    return t.T5ForConditionalGeneration(t.T5Config(d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4,
                                                   vocab_size=50, decoder_start_token_id=0)).eval()


def gpt2_cross() -> torch.nn.Module:
    torch.manual_seed(0)
    return t.GPT2LMHeadModel(t.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=50, n_positions=32,
                                          add_cross_attention=True)).eval()


def llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=50)
    return t.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("options", [
    {"kv": ("window", {"sinks": 1, "window": 4})},
    {"kv": ("snapkv", {"budget": 4})},
    {"router": ("topk", {"kv_groups": True, "stream_window": 4, "stream_sinks": 1})},
])
def test_t5_holds_a_kv_policy_that_adds_its_position_bias(options: dict[str, object]) -> None:
    # T5's decoder used to refuse these (its bias did not reach a policy's own state); the policies now add it
    # (tests/integrations/hf/test_t5_kv_policies.py), and a policy that cannot is refused there
    model = t5()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), target_modules=[T5_DECODER_SELF],
                                      **options)  # type: ignore[arg-type]
    assert len(condcomp.apply_(model, cfg)) == 2


def test_layers_without_a_request_cache_refuse_a_policy_that_keeps_unkept_groups_at_their_first_call() -> None:
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), kv="full")
    model = t5()
    condcomp.apply_(model, cfg)  # encoder, decoder self- and cross-attention
    ids = torch.randint(1, 50, (1, 4))
    with pytest.raises(ValueError, match=r"an encoder's self-attention.*'full'.*Wrap only the decoder's self"):
        model(input_ids=ids, decoder_input_ids=ids)
    model = gpt2_cross()
    condcomp.apply_(model, cfg)
    with pytest.raises(ValueError, match=r"cross-attention.*'full'.*Wrap only the decoder's self"):
        model(input_ids=ids, encoder_hidden_states=torch.randn(1, 3, 32))
    torch.manual_seed(0)
    model = t.BertModel(t.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=37, vocab_size=50)).eval()  # an encoder
    condcomp.apply_(model, cfg)
    with pytest.raises(ValueError, match=r"an encoder's self-attention.*'full'"):
        model(input_ids=ids)


def test_the_attention_function_attachment_refuses_a_window_policy() -> None:
    from condcomp.integrations.hf.interface import apply_interface_, cores

    model = llama()
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=("topk", {"kv_groups": True}),
                                  kv=("window", {"sinks": 1, "window": 4}))
    with pytest.raises(ValueError, match="apply_interface_: kv='window'"):
        apply_interface_(model, cfg)
    assert cores(model) == {}
    assert condcomp.apply_(model, cfg)  # the module swap holds it on a Llama


def _cache_bytes_after_decoding(model: torch.nn.Module) -> int:
    from condcomp.integrations.hf.cache import cache_bytes

    ids = torch.randint(1, 50, (2, 12), generator=torch.Generator().manual_seed(0))
    cache = t.DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return sum(cache_bytes(cache))


@pytest.mark.parametrize("router", ["norm", ("moh", {"shared_heads": 1, "top_k": 1})])
@pytest.mark.parametrize("kv", [("window", {"sinks": 1, "window": 2}), "full", "snapkv"])
def test_a_per_token_router_refuses_a_kv_policy_it_would_ignore(router: object, kv: object) -> None:
    """Red team round 5: a per-token router caches every key/value head, so kv= was ignored without a word (the
    cache held the unwrapped model's bytes)."""
    dense = _cache_bytes_after_decoding(llama())
    model = llama()
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=router, kv=kv)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"apply_: kv=.*decides per token.*kv='drop'"):
        condcomp.apply_(model, cfg)
    assert condcomp.routed_modules(model) == {}
    condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}), router=router))
    assert _cache_bytes_after_decoding(model.eval()) == dense  # what kv= would have silently left


def test_a_per_token_budget_under_a_sequence_router_refuses_a_kv_policy_at_the_call() -> None:
    model = llama()
    cfg = condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5, "per_token": True}),
                                  router=("topk", {"kv_groups": True}), kv=("window", {"sinks": 1, "window": 2}))
    condcomp.apply_(model, cfg)
    with pytest.raises(ValueError, match=r"kv='window'.*plan is per token.*per-sequence budget"):
        _cache_bytes_after_decoding(model.eval())
    sequence = llama()
    condcomp.apply_(sequence, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.5}),
                                                      router=("topk", {"kv_groups": True}), kv=cfg.kv))
    assert _cache_bytes_after_decoding(sequence.eval()) < _cache_bytes_after_decoding(llama())  # streamed: smaller
