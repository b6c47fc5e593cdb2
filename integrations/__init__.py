"""Adapters for third-party attention modules. ``hf`` and ``timm`` load lazily, only for models that use them."""

from condcomp.integrations import torch_mha  # noqa: F401
