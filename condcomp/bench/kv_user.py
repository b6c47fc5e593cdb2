"""A user's KV policy as a variant of ``condcomp bench kv``: ``--variants my_kv:FirstTokensKV`` (a module beside
you or on ``PYTHONPATH``) or ``--variants path/to/my_kv.py:FirstTokensKV``, beside the built-in variants and
kvpress's presses.

The spec names one of:

- a :class:`condcomp.KVPolicy` subclass (registered by its ``@condcomp.register_kv_policy`` decorator, else under its
  class name in lower case), built with its default options: every KV group of every layer is held by it (the
  plan keeps no group in full), as the ``snapkv-*`` variants are;
- a function ``factory(model) -> model`` that wraps a copy of the dense model as you choose (``condcomp.apply_``
  with your policy on some groups, a split of your own): the variant measures what it returns.

The variant is named ``user-<name>`` (``<name>`` in lower case) in the records and the table; its note says what
the spec was, so a record says where its numbers came from.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from condcomp.bench.kv_variants import DEFAULT_VARIANTS, MODELS, SPLIT_GRAMMAR, VARIANTS, KVVariant, ModelContext
from condcomp.user_spec import is_spec, load_attribute

EXAMPLE = "my_kv.py:FirstTokensKV"


def variant_name(spec: str) -> str:
    """``user-<attribute in lower case>``: the variant of ``spec`` in records and tables."""
    return f"user-{spec.rpartition(':')[2].lower()}"


def add_variants_argument(parser: Any) -> None:
    """``bench kv --variants``: registered variant names (dense is always run) or a user's specs."""
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), metavar="NAME",
                        help=f"of: {', '.join(VARIANTS)} (dense is always run); or a split named "
                             f"{SPLIT_GRAMMAR}; or your KV policy as "
                             "module:Class or path/to/file.py:Class (a KVPolicy subclass holding every KV group, "
                             "or a function factory(model) -> model), named user-<name>; see docs/extending-kv.md")


def add_user_variants(names: list[str], timed: list[str] | None) -> tuple[list[str], list[str] | None]:
    """``(names, timed)`` with every spec among them imported, added to the variants and replaced by its variant's
    name; other names are left as they are (unknown ones are refused later, listing the variants)."""
    def resolved(name: str) -> str:
        return _add(name) if is_spec(name) else name

    return [resolved(n) for n in names], None if timed is None else [resolved(n) for n in timed]


def _add(spec: str) -> str:
    import condcomp
    from condcomp.registry import KV_POLICIES

    obj = load_attribute(spec, "bench kv variant", EXAMPLE)
    name = variant_name(spec)
    if isinstance(obj, type) and issubclass(obj, condcomp.KVPolicy):
        key = vars(obj).get("registry_key")
        if key is None or key not in KV_POLICIES.names() or KV_POLICIES.get(key) is not obj:
            key = spec.rpartition(":")[2].lower()
            KV_POLICIES.register(key)(obj)  # a key taken by another class: a ValueError naming both
        prepare = _every_group_held_by(str(key))
        note = f"your KV policy {spec} (registered as {key!r}) holding every KV group of every layer"
    elif isinstance(obj, type):
        raise ValueError(f"bench kv variant {spec!r}: {obj.__name__} is a class but not a condcomp.KVPolicy "
                         "subclass; name a KVPolicy subclass or a function factory(model) -> model")
    elif callable(obj):
        prepare = _factory(obj, spec)
        note = f"your factory {spec}: the model it returns from a copy of the dense one"
    else:
        raise ValueError(f"bench kv variant {spec!r}: {spec.rpartition(':')[2]} is a {type(obj).__name__}; name a "
                         "KVPolicy subclass or a function factory(model) -> model")
    if name in VARIANTS and VARIANTS[name].note != note:
        raise ValueError(f"bench kv variant {spec!r}: its name {name!r} is taken by another variant "
                         f"({VARIANTS[name].note}); rename the class or function")
    MODELS[name] = prepare
    VARIANTS[name] = KVVariant(name, note=note)
    return name


def _every_group_held_by(key: str) -> Any:
    def prepare(dense: nn.Module, ctx: ModelContext) -> nn.Module:
        import condcomp

        model = copy.deepcopy(dense)
        condcomp.apply_(model, condcomp.CondCompConfig(policy=("fixed", {"fraction": 0.0, "k_min": 0}),
                                                       router=("topk", {"kv_groups": True}), kv=key))
        return model.eval()
    return prepare


def _factory(factory: Any, spec: str) -> Any:
    def prepare(dense: nn.Module, ctx: ModelContext) -> nn.Module:
        model = factory(copy.deepcopy(dense))
        if not isinstance(model, nn.Module):
            raise TypeError(f"bench kv variant {spec!r}: the factory returned a {type(model).__name__}, not the "
                            "model (an nn.Module)")
        return model.eval()
    return prepare
