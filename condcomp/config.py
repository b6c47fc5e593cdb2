"""CondCompConfig: which policy, router, executor and KV policy, and which modules to wrap. Validated; JSON
round-trip."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, ClassVar

from condcomp.executors.auto import executor_key_error
from condcomp.kv.choose import build_kv_policy
from condcomp.options import Option, check_fields, flag
from condcomp.registry import EXECUTORS, KV_POLICIES, POLICIES, ROUTERS

ComponentSpec = str | tuple[str, dict[str, Any]] | list[Any]


def normalize_spec(spec: Any, role: str) -> tuple[str, dict[str, Any]]:
    """``"key"`` or ``("key", {kwargs})`` (or a JSON list of the same) -> ``("key", kwargs)``."""
    if isinstance(spec, str):
        return spec.lower(), {}
    if isinstance(spec, (tuple, list)) and len(spec) == 2 and isinstance(spec[0], str) and isinstance(spec[1], dict):
        return spec[0].lower(), dict(spec[1])
    raise TypeError(f"{role} must be a key like 'fixed' or a pair like ('fixed', {{'fraction': 0.5}}), got {spec!r}")


def _patterns(value: Any, name: str) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        # PEFT's habit: one string is a regular expression over the full name (an exact name is one too).
        return [value if value.startswith(("re:", ".")) else "re:" + value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise TypeError(f"{name} must be None, a string or a list of strings, got {value!r}")


def dataclass_from_dict(cls: Any, d: dict[str, Any], label: str) -> Any:
    """``cls(**d)`` for a config dataclass, naming unknown fields (a typo in a JSON config) instead of a TypeError."""
    names = set(cls.__dataclass_fields__)
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"unknown {label} fields {unknown}; valid: {sorted(names)}")
    return cls(**d)


@dataclass
class CondCompConfig:
    r"""What to wrap and how.

    - ``policy``: budget policy key or ``(key, kwargs)``: ``"full"``, ``("fixed", {"fraction": 0.5})``, ...
    - ``router``: router key or ``(key, kwargs)``.
    - ``executor``: ``"reference" | "masked" | "gathered" | "auto"``.
    - ``target_modules`` / ``exclude_modules``: None (every supported attention module) or patterns, as PEFT
      users write them: a list of names, each matching that module or any module whose name ends with
      ``"." + name`` (``["self_attn"]``), or one string, a regular expression over the full name
      (``r".*\.layers\.[0-3]\.self_attn"``); also ``".suffix"`` and ``"re:<regex>"`` entries.
    - ``kv``: KV policy key or ``(key, kwargs)``: what a decoder request's cache keeps of the key/value groups its
      plan does not keep: ``"drop"`` (the default: nothing), ``"full"``, ``("window", {"sinks": 4, "window": 64})``
      (see :mod:`condcomp.kv`; ``condcomp.list_kv_policies()``).
    - ``decode_kernel``: a decoder request's decode steps on a static cache (``cache_implementation="static"``)
      attend its compact cache with one split-K kernel launch per layer over the kept groups' tokens
      (:func:`condcomp.kv.kernels.compact_decode_attention`: Triton on CUDA, its torch fallback elsewhere) instead
      of SDPA over the padded storage and a mask. Off by default: it has not been timed on a GPU
      (docs/llm-compiled.md).
    - ``share_policy``: one budget policy for all wrapped layers (one budget per example for the whole model).
    - ``check_inputs``: reject NaN/inf inputs with a clear error instead of letting them propagate.

    >>> cfg = CondCompConfig(policy=("fixed", {"fraction": 0.5}), router="random", executor="masked")
    >>> CondCompConfig.from_dict(cfg.to_dict()) == cfg
    True
    """

    policy: Any = "full"
    router: Any = "topk"
    executor: str = "auto"
    target_modules: Any = None
    exclude_modules: Any = None
    share_policy: bool = False
    check_inputs: bool = False
    kv: Any = "drop"
    decode_kernel: bool = False
    options: ClassVar[tuple[Option, ...]] = (flag("share_policy"), flag("check_inputs"), flag("decode_kernel"))

    def __post_init__(self) -> None:
        check_fields(self, "CondCompConfig")  # "false" would be a true flag
        self.policy = normalize_spec(self.policy, "policy")
        self.router = normalize_spec(self.router, "router")
        POLICIES.check_kwargs(*self.policy)
        ROUTERS.check_kwargs(*self.router)
        self.kv = normalize_spec(self.kv, "kv")
        KV_POLICIES.check_kwargs(*self.kv)
        build_kv_policy(self.kv)  # its values checked now, before any model exists
        if self.kv[0] != "drop" and self.router[1].get("stream_window") is not None:
            raise ValueError(f"the router's stream_window and kv={self.kv[0]!r} both say what the groups a plan does "
                             "not keep hold: set kv=('window', {'sinks': s, 'window': n}) and drop stream_window")
        if not isinstance(self.executor, str):
            raise TypeError(executor_key_error(self.executor))
        self.executor = self.executor.lower()
        if self.executor != "auto":
            EXECUTORS.get(self.executor)
        self.target_modules = _patterns(self.target_modules, "target_modules")
        self.exclude_modules = _patterns(self.exclude_modules, "exclude_modules")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["policy"] = [self.policy[0], self.policy[1]]
        d["router"] = [self.router[0], self.router[1]]
        d["kv"] = [self.kv[0], self.kv[1]]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CondCompConfig:
        if d.get("extra") == {}:  # a config with an always-empty ``extra`` (a field nothing reads) loads without it
            d = {k: v for k, v in d.items() if k != "extra"}
        return dataclass_from_dict(cls, d, "CondCompConfig")

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CondCompConfig:
        return cls.from_dict(json.loads(text))
