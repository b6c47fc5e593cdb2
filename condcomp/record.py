"""The routing record: which modules a model's ``apply_`` calls wrapped, and with which config.

It is what a loader needs to rebuild a wrapped model from its plain weights. ``apply_`` and ``remove_`` keep it in
a transformers model's config (``model.config.condcomp``), so ``model.save_pretrained(dir)`` (what Trainer and
``push_to_hub`` call) writes it into ``config.json`` beside the routing tensors, and
``condcomp.integrations.hf.checkpoint.from_pretrained`` replays it (``apply_record``).

>>> record = routing_record(model)  # doctest: +SKIP
>>> record["groups"][0]["modules"]  # doctest: +SKIP
['encoder.layer.0.attention', 'encoder.layer.1.attention']
"""

from __future__ import annotations

from typing import Any

from torch import nn

from condcomp.routed import RoutedAttention

RECORD_VERSION = 1


def routing_record(model: nn.Module) -> dict[str, Any] | None:
    """``{"version": 1, "groups": [{"config": CondCompConfig dict, "modules": [names]}, ...]}``, one group per
    distinct config (one per ``apply_`` call that used it); None when nothing is wrapped."""
    groups: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for name, routed in model.named_modules():
        if not isinstance(routed, RoutedAttention):
            continue
        config = routed.condcomp_config
        if config is None:
            raise ValueError(f"{name} was wrapped without a CondCompConfig (RoutedAttention built by hand); "
                             "wrap it with condcomp.apply_ so that it can be saved and rebuilt")
        groups.setdefault(config.to_json(), (config.to_dict(), []))[1].append(name)
    if not groups:
        return None
    return {"version": RECORD_VERSION, "groups": [{"config": c, "modules": m} for c, m in groups.values()]}


def store_record_in_config(model: nn.Module) -> None:
    """Keep ``model.config.condcomp`` (a transformers config) equal to the model's routing record."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return  # not a transformers model (or wrapped below its top): condcomp's own checkpoints carry the config
    record = routing_record(model)
    if record is None:
        config.__dict__.pop("condcomp", None)
    else:
        config.condcomp = record
