"""What ``condcomp.integrations.hf.internals`` relies on in transformers, checked against the installed release: each
test names the contact and says what changed when it fails, so a transformers upgrade that breaks one is found here
and not as a wrong answer elsewhere."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

t = pytest.importorskip("transformers")
from condcomp.integrations.hf import internals  # noqa: E402
from transformers import cache_utils  # noqa: E402

LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer", "StaticLayer", "StaticSlidingWindowLayer", "QuantizedLayer",
          "Fp8QuantizedLayer")
CARRIED = {"reset": [], "crop": ["tokens_to_remove"], "reorder_cache": ["beam_idx"],
           "batch_select_indices": ["indices"], "batch_repeat_interleave": ["repeats"],
           "update": ["key_states", "value_states"]}


def changed(contact: str, what: str) -> str:
    return (f"transformers {t.__version__} changed what condcomp.integrations.hf.internals.{contact} relies on "
            f"(checked against {internals.TRANSFORMERS_CHECKED}): {what}. Read the function's docstring and adapt it")


def small_llama() -> Any:
    torch.manual_seed(0)
    config = t.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=40)
    return t.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("name", LAYERS)
def test_cache_layers_have_the_methods_condcomps_layer_hands_them(name: str) -> None:
    cls = getattr(cache_utils, name, None)
    assert cls is not None, changed("DELEGATED_LAYER_FLAGS", f"cache_utils.{name} no longer exists")
    for method, params in CARRIED.items():
        fn = getattr(cls, method, None)
        if fn is None and name.startswith("Static") and method.startswith("batch_"):
            continue  # static layers never had row selection (transformers refuses it on a static cache)
        assert callable(fn), changed("DELEGATED_LAYER_FLAGS", f"{name}.{method} is gone (PlanLayer hands it on)")
        names = list(inspect.signature(fn).parameters)[1:1 + len(params)]
        assert names == params, changed("DELEGATED_LAYER_FLAGS", f"{name}.{method}'s parameters are now {names}, "
                                        f"PlanLayer calls it with {params}")
    assert "is_initialized" in inspect.getsource(cls.__init__) or "is_initialized" in inspect.getsource(
        cache_utils.CacheLayerMixin.__init__), changed("layer_initialized", f"{name} no longer sets is_initialized")


def test_every_class_level_attribute_of_the_layer_base_is_answered_by_the_wrapped_layer() -> None:
    """A name the base class defines is found on condcomp's wrapping layer itself (not read through): each must be
    a method the wrapper hands on or a flag it delegates, or the Cache would read the base's default."""
    from condcomp.integrations.hf.kv_layer import PlanLayer

    base = {n for n in vars(cache_utils.CacheLayerMixin) if not n.startswith("_")}
    own = {n for n in base if getattr(PlanLayer, n) is not getattr(cache_utils.CacheLayerMixin, n)}
    assert base <= own, changed("DELEGATED_LAYER_FLAGS", f"CacheLayerMixin now defines {sorted(base - own)}, which "
                                "condcomp's PlanLayer neither hands on nor delegates")
    flags = {n for c in map(lambda n: getattr(cache_utils, n), LAYERS) for n, v in vars(c).items()
             if not n.startswith("_") and isinstance(v, bool)}
    assert flags <= set(internals.DELEGATED_LAYER_FLAGS), changed(
        "DELEGATED_LAYER_FLAGS", f"cache layer classes now set the class flags {sorted(flags)}")
    assert all(isinstance(vars(PlanLayer)[n], property) for n in internals.DELEGATED_LAYER_FLAGS)


def test_a_lazily_growing_cache_builds_its_new_layers_with_the_factory_given() -> None:
    assert "self.layer_class_to_replicate()" in inspect.getsource(cache_utils.Cache.update), changed(
        "new_layer_factory", "Cache.update no longer builds a missing layer by calling layer_class_to_replicate()")
    cache = t.DynamicCache()
    built: list[Any] = []

    def wrap(factory: Any) -> Any:
        return lambda: built.append(factory()) or built[-1]

    internals.new_layer_factory(cache, wrap)
    cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 1)
    assert len(built) == 2 and cache.layers == built, changed(
        "new_layer_factory", "DynamicCache() no longer builds its layers lazily from layer_class_to_replicate")


def test_a_static_layer_flipped_to_uninitialised_allocates_again_at_its_next_update() -> None:
    layer = cache_utils.StaticLayer(max_cache_len=8)
    layer.update(torch.zeros(1, 4, 2, 4), torch.zeros(1, 4, 2, 4), cache_kwargs={"cache_position": torch.arange(2)})
    assert tuple(layer.keys.shape) == (1, 4, 8, 4) and internals.layer_initialized(layer)
    layer.reset()  # allocated but empty: the case condcomp re-allocates
    internals.reallocate_static_layer(layer)
    layer.update(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4), cache_kwargs={"cache_position": torch.arange(2)})
    assert tuple(layer.keys.shape) == (1, 2, 8, 4), changed(
        "reallocate_static_layer", f"a StaticLayer with is_initialized=False kept its {tuple(layer.keys.shape)} "
        "tensors at its next update instead of allocating them again from the states given")


def test_cache_class_names_the_sniffing_relies_on_still_exist() -> None:
    assert t.StaticCache.__name__.startswith("Static"), changed("is_static_cache", "StaticCache was renamed")
    assert hasattr(cache_utils.StaticLayer(max_cache_len=4), "max_cache_len"), changed(
        "is_static_cache", "StaticLayer has no max_cache_len")
    assert not internals.is_static_cache(t.DynamicCache(), cache_utils.DynamicLayer())
    from transformers.generation.continuous_batching import cache as paged

    assert hasattr(paged, "PagedAttentionCache"), changed("is_paged_cache", "PagedAttentionCache was renamed/moved")


@pytest.mark.parametrize("model", ["llama", "mistral", "qwen2", "qwen3", "gemma", "gpt2", "bert"])
def test_attention_modules_dispatch_through_the_registry_by_name(model: str) -> None:
    import importlib

    module = importlib.import_module(f"transformers.models.{model}.modeling_{model}")
    classes = [c for n, c in vars(module).items() if n.endswith(("Attention", "SelfAttention"))
               and isinstance(c, type) and issubclass(c, torch.nn.Module) and "forward" in vars(c)]
    assert classes and any(internals.forward_uses_attention_interface(c) for c in classes), changed(
        "forward_uses_attention_interface", f"no attention module of modeling_{model} names ALL_ATTENTION_FUNCTIONS")


def test_generate_runs_as_a_frame_of_its_own_code_with_the_model_as_self() -> None:
    assert internals.generate_code() is not None, changed("generate_on_stack", "GenerationMixin.generate is gone")
    model = small_llama()
    seen: list[bool] = []

    def check() -> bool:  # the caller of generate_on_stack is a check, as in generation_check.py
        return internals.generate_on_stack(lambda owner: owner is model)

    model.model.layers[0].self_attn.register_forward_hook(lambda *a: seen.append(check()))
    model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, do_sample=False, pad_token_id=0)
    assert seen and all(seen), changed("generate_on_stack", "no frame on the stack of a generate() call has "
                                       "GenerationMixin.generate's code with the model as self")
    seen.clear()
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert seen == [False]


def test_a_static_layer_counts_its_tokens_in_a_device_scalar_it_advances_and_crops_in_place() -> None:
    layer = cache_utils.StaticLayer(max_cache_len=8)
    k = torch.zeros(1, 2, 3, 4)
    layer.update(k, k)
    held = internals.static_held(layer)
    assert isinstance(held, torch.Tensor) and held.dim() == 0 and int(held) == 3, changed(
        "static_held", "StaticLayer.cumulative_length is not the int64 scalar of the tokens it holds")
    layer.update(k[:, :, :1], k[:, :, :1])
    layer.crop(-2)
    assert internals.static_held(layer) is held and int(held) == 2, changed(
        "static_held", "StaticLayer no longer advances / crops cumulative_length in place (a compiled step would read "
        "a stale tensor)")
    sliding = cache_utils.StaticSlidingWindowLayer(max_cache_len=8, sliding_window=4)
    sliding.update(k, k)
    assert internals.static_held(sliding) is None and internals.host_length(sliding) == 3, changed(
        "host_length", "StaticSlidingWindowLayer no longer counts its tokens in cumulative_length_int")
    assert internals.counts_on_device(layer) and not internals.counts_on_device(sliding), changed(
        "counts_on_device", "StaticLayer / StaticSlidingWindowLayer no longer tell max_cache_len and is_sliding apart")
    dynamic = cache_utils.DynamicLayer()
    assert not internals.counts_on_device(dynamic) and internals.held_count(dynamic) == 0
    dynamic.update(k, k)
    # held_count: the same scalar for a static layer, the host counts for the others (one read, any layer)
    assert internals.held_count(layer) is held and internals.held_count(sliding) == 3, changed(
        "held_count", "the static layers' counts moved")
    assert internals.held_count(dynamic) == 3, changed("held_count", "DynamicLayer.get_seq_length changed")
