"""Reading a projection's effective weight and bias exactly, or saying why it cannot be read.

Executors compute with per-head slices of the projection weights, so an adapter reads ``weight`` and ``bias``
instead of calling the projection. That is exact for a plain ``nn.Linear``. For a PEFT LoRA layer it would be
wrong (``.weight`` is the base weight), so the LoRA update is added: ``W + scaling * B @ A`` per active adapter
(PEFT's own ``get_delta_weight``), and ``scaling * lora_B.bias`` where the adapter has one. Gradients reach
``A`` and ``B`` through it. Without autograd the merged weight is cached until a tensor or the adapter state
changes, so decoding does not merge again at every step.

transformers' ``Conv1D`` (GPT-2's projections) computes ``x @ weight + bias`` with ``weight (in, out)``: it is read
as ``weight.T`` (a view), and PEFT LoRA on it (``fan_in_fan_out=True``, delta in the same ``(in, out)`` layout)
has its delta transposed back.

Everything else is refused with the module's name: quantized layers (bitsandbytes, torchao tensor subclasses),
offloaded weights (accelerate), Linear subclasses condcomp does not know, DoRA and other LoRA variants,
LoRA dropout while training, mixed-adapter batches. Reading those as plain weights would silently compute
something else.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn

from condcomp.versions import tensor_version

# Exact classes whose forward is F.linear(x, weight, bias) and nothing else.
PLAIN_LINEARS: tuple[type, ...] = (nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear)


class ProjectionError(TypeError):
    """A projection condcomp cannot read exactly; the message names the module and what to do."""


def _is_hf_conv1d(module: Any) -> bool:
    # The exact class, recognised without importing transformers (``import condcomp`` must not); subclasses may
    # compute something else and are refused like unknown Linear subclasses.
    cls = type(module)
    return cls.__module__ == "transformers.pytorch_utils" and cls.__qualname__ == "Conv1D"


def _is_peft_lora(module: nn.Module) -> bool:
    return type(module).__module__.startswith("peft.") and hasattr(module, "lora_A") and hasattr(module, "base_layer")


def tensor_problem(t: Any, what: str) -> str | None:
    """Why a weight or bias tensor cannot be read as plain dense numbers, or None."""
    if t is None:
        return None
    if not isinstance(t, Tensor):
        return f"{what} is a {type(t).__name__}, not a tensor"
    data = t.data if isinstance(t, nn.Parameter) else t
    if type(data) is not Tensor:
        return (f"{what} is a {type(data).__name__} (a quantized or otherwise packed tensor subclass); "
                "dequantize the model or load it unquantized before condcomp.apply_")
    if not t.is_floating_point():
        return f"{what} has dtype {t.dtype} (quantized storage); load the model in a floating dtype"
    if t.layout != torch.strided:
        return f"{what} has layout {t.layout}; condcomp reads dense weights"
    return None


def projection_problem(module: Any) -> str | None:
    """Why ``module`` cannot be read as a projection (None when it can); nothing is computed."""
    if _is_peft_lora(module):
        problem = projection_problem(module.base_layer)
        return f"base_layer: {problem}" if problem else _lora_problem(module, training_check=False)
    if not isinstance(module, nn.Module):
        return f"expected a Linear layer, found {type(module).__name__}"
    if getattr(module, "_hf_hook", None) is not None and module.weight.is_meta:
        return ("its weight is offloaded (accelerate's device_map moves it in only when the layer is called, and "
                "condcomp reads weights without calling it); load the model onto one device before condcomp.apply_")
    if type(module) not in PLAIN_LINEARS and not _is_hf_conv1d(module):
        return (f"{type(module).__module__}.{type(module).__qualname__} is not a plain nn.Linear (quantized or "
                "custom layers compute something condcomp cannot read from .weight); supported: nn.Linear, "
                "transformers' Conv1D and PEFT LoRA on them")
    return tensor_problem(module.weight, "weight") or tensor_problem(module.bias, "bias")


def linear_parts(module: Any, name: str) -> tuple[Tensor, Tensor | None]:
    """The effective ``(weight (out, in), bias (out,) | None)`` of projection ``module`` (called ``name`` in errors).

    >>> w, b = linear_parts(nn.Linear(4, 2), "q_proj")
    >>> tuple(w.shape), tuple(b.shape)
    ((2, 4), (2,))
    """
    if type(module) in PLAIN_LINEARS:
        weight, bias = module._parameters["weight"], module._parameters.get("bias")
        # Checked before with these very tensors and no hooks since: skip the checks (every decode step reads
        # every projection of every layer).
        if (module.__dict__.get("_condcomp_checked") == (id(weight), id(bias))
                and not module._forward_hooks and not module._forward_pre_hooks):
            return weight, bias
    elif _is_peft_lora(module):
        return _lora_parts(module, name)
    problem = projection_problem(module)
    if problem is not None:
        raise ProjectionError(f"{name}: {problem}")
    _warn_hooks(module, name)
    if _is_hf_conv1d(module):
        return module.weight.T, module.bias  # Conv1D stores (in, out): x @ weight + bias
    module.__dict__["_condcomp_checked"] = (id(module.weight), id(module.bias))
    return module.weight, module.bias


def _warn_hooks(module: nn.Module, name: str) -> None:
    if (module._forward_hooks or module._forward_pre_hooks) and not module.__dict__.get("_condcomp_hook_warned"):
        module.__dict__["_condcomp_hook_warned"] = True
        warnings.warn(f"{name} has forward hooks, which do not run: condcomp reads its weight and bias instead of "
                      "calling it (hooks that only observe lose their calls; hooks that change the output are "
                      "ignored)", stacklevel=4)


def _lora_problem(layer: Any, training_check: bool) -> str | None:
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        if getattr(layer, "use_dora", {}).get(adapter) or adapter in getattr(layer, "lora_variant", {}):
            return (f"LoRA adapter {adapter!r} is DoRA or another LoRA variant, which condcomp cannot express as a "
                    "weight update; use plain LoRA, or merge it (model.merge_and_unload()) before condcomp.apply_")
        drop = layer.lora_dropout[adapter]
        if training_check and isinstance(drop, nn.Dropout) and drop.p > 0 and drop.training:
            return (f"LoRA adapter {adapter!r} has lora_dropout={drop.p} and is training: dropout on the adapter's "
                    "input cannot be folded into a weight; set lora_dropout=0.0 in the LoraConfig")
    for hook in layer._forward_pre_hooks.values():
        if "adapter_names" in repr(hook):
            return ("called with adapter_names= (mixed-adapter batches), which condcomp cannot honour; "
                    "activate one adapter (model.set_adapter) instead")
    return None


def _lora_parts(layer: Any, name: str) -> tuple[Tensor, Tensor | None]:
    weight, bias = linear_parts(layer.base_layer, f"{name}.base_layer")
    if layer.disable_adapters or layer.merged:  # PEFT then calls the base layer alone (merged: W holds BA)
        return weight, bias
    problem = _lora_problem(layer, training_check=True)
    if problem is not None:
        raise ProjectionError(f"{name}: {problem}")
    adapters = [a for a in layer.active_adapters if a in layer.lora_A]
    tensors = [weight, *([] if bias is None else [bias])]
    for a in adapters:
        tensors += [layer.lora_A[a].weight, *layer.lora_B[a].parameters()]
    versions = tuple((id(t), tensor_version(t)) for t in tensors)
    cacheable = not torch.is_grad_enabled() and all(v is not None for _, v in versions)
    key = (tuple(adapters), tuple(layer.scaling[a] for a in adapters), versions)
    cached = layer.__dict__.get("_condcomp_merged")
    if cacheable and cached is not None and cached[0] == key:
        return cached[1], cached[2]
    for a in adapters:
        delta = layer.get_delta_weight(a).to(weight.dtype)  # scaling * B @ A, in the base weight's storage layout
        weight = weight + (delta.T if getattr(layer, "fan_in_fan_out", False) else delta)  # (out, in)
        lora_b = layer.lora_B[a].bias
        if lora_b is not None:
            scaled = (lora_b * layer.scaling[a]).to(weight.dtype)
            bias = scaled if bias is None else bias + scaled
    if cacheable:
        # The tensors are held with the key, so their ids cannot be reused by other tensors while it is cached.
        layer.__dict__["_condcomp_merged"] = (key, weight, bias, tensors)
    return weight, bias
