"""A compact KV cache layer: what one layer of a request's cache holds beside the keys, and how it is written.

:class:`CompactLayer` is the part of condcomp's cache layer that knows nothing of the library whose cache it
lives in: the request's plan (:class:`~condcomp.kv.selection.HeldPlan`, one row per cache row), the state of the
groups the plan's KV policy holds, and every row operation on both (reset, crop, reorder/select rows, repeat rows).
The keys of the kept groups are stored by the layer it wraps (``inner``: transformers' ``DynamicLayer``, a
quantized layer, ...), which it hands them to through its own :meth:`update`.

The ``kv_cache`` executor writes a request's compact cache through it: :meth:`store` appends the kept groups'
keys and values; the KV policy reads and keeps its own state here in the same call
(:meth:`~condcomp.kv.policy.KVPolicy.attend_in`: :meth:`hold_state` with the state as the policy stores it in this
layer, ``condcomp_codec``: quantized inside a quantized layer); :meth:`policy_state` / :meth:`keep_policy_state` do
the same for a caller that holds the state itself between calls. The transformers class is
``condcomp.integrations.hf.kv_layer.PlanLayer``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from condcomp.kv.policy import KVPolicy
from condcomp.kv.selection import HeldPlan

_WRITING = threading.local()  # set while a wrapped layer writes a compact cache (others may not)


@contextlib.contextmanager
def compact_write() -> Iterator[None]:
    """Inside the block, writes of kept groups into a compact cache layer are the wrapped model's own."""
    before = getattr(_WRITING, "on", False)
    _WRITING.on = True
    try:
        yield
    finally:
        _WRITING.on = before


def held_policy(layer: Any) -> KVPolicy | None:
    """The KV policy whose state ``layer`` holds (the held plan's), or None."""
    held = layer.__dict__.get("condcomp_plan")
    return None if held is None or held.selection is None else held.selection.policy


class CompactLayer:
    """The plan, the KV policy's state and their row operations of one cache layer; the keys are ``inner``'s.

    A subclass (the library's cache layer class) provides :meth:`held_tokens`, sets ``condcomp_codec`` and
    ``condcomp_preallocated`` when it wraps a layer, and holds the wrapped layer as ``inner`` (with ``update``,
    ``reset``, ``crop``, ``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``)."""

    condcomp_plan: HeldPlan | None = None
    # the state of the groups the plan's KV policy holds (a streaming window: trimmed keys/values), as the policy
    # stores it in this layer (quantized in a quantized layer, see condcomp_codec)
    condcomp_windows: Any = None
    # resolved once when the library's layer is wrapped (a decode step reads them as data, calling nothing back):
    # how the policy's state is stored in this layer (a WindowCodec, None: full precision), and whether its
    # storage is preallocated (False: it grows, so a policy's state never moves into fixed slots; None: ask
    # fixed_slot_room)
    condcomp_codec: Any = None
    condcomp_preallocated: bool | None = None
    condcomp_placeholder: int = 1  # the width of the token-counting placeholder of a layer with no full group
    # the executor the request's first call resolved, which runs its later calls (hold_executor)
    condcomp_executor: Any = None
    inner: Any

    def held_tokens(self) -> int:
        """Tokens the layer holds (0 when empty), on the host."""
        raise NotImplementedError

    def held_position(self) -> Tensor | None:
        """Tokens the layer holds as a device scalar that its writes advance in place (preallocated storage:
        :mod:`condcomp.kv.static`), or None where the count is not kept on the device."""
        return None

    def fixed_slot_room(self) -> int | None:
        """Tokens the layer's preallocated storage can still take (a static cache), or None where it grows: a KV
        policy's state is then preallocated too (:meth:`~condcomp.kv.policy.KVPolicy.fixed_slots`)."""
        return None

    def state_codec(self) -> Any:
        """How the KV policy's state is stored in this layer (a ``WindowCodec``), or None: full precision (its
        ``condcomp_codec``, which the policy reads as data)."""
        return self.condcomp_codec

    # ---- how the kv_cache executor writes it --------------------------------------------------------------------
    def store(self, k: Tensor, v: Tensor, cache_kwargs: Any = None) -> tuple[Tensor, Tensor]:
        """Append the kept groups' ``(B, g, T, Dh)``; their whole history ``(B, g, S, Dh)``. ``cache_kwargs``: the
        call's cache arguments, which the wrapped layer reads (``cache_position``, ...)."""
        with compact_write():
            return self.update(k, v, kwargs=cache_kwargs)  # type: ignore[no-any-return]  # as Cache.update passes it

    def policy_state(self, policy: KVPolicy | None = None) -> Any:
        """The KV policy's state held before this call, as the executor reads it (a window dequantized if stored
        so); ``policy``: the policy that stored it (default: the held plan's; :meth:`KVPolicy.state_in`)."""
        policy = policy if policy is not None else held_policy(self)
        return self.condcomp_windows if policy is None else policy.state_in(self)

    def keep_policy_state(self, state: Any, policy: KVPolicy | None = None) -> None:
        """Keep ``state`` of ``policy`` (default: the held plan's) as the policy stores it in this layer
        (:meth:`KVPolicy.keep_in`: a window quantized when the layer quantizes its keys, so it is held as compactly
        as they are; in a preallocated layer, in storage allocated once at the prefill)."""
        policy = policy if policy is not None else held_policy(self)
        if policy is None:
            self.hold_state(state)
        else:
            policy.keep_in(self, state)

    def hold_state(self, stored: Any) -> None:
        """Hold ``stored`` (the policy's state as the policy stores it here) as this layer's own data."""
        self.__dict__["condcomp_windows"] = stored  # (a library wrapper's __setattr__ not called)

    def hold_executor(self, executor: Any) -> None:
        """Hold the executor the request's first call resolved (one that runs and records a call in one,
        ``attend``), so its later calls enter it once; None: resolve the executor at every call."""
        self.__dict__["condcomp_executor"] = executor

    # ---- the cache operations, on the plan and the policy's state too -------------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        held = self.condcomp_plan
        compact = held is not None and held.selection is not None and not held.selection.identity
        if compact and not getattr(_WRITING, "on", False) and self.held_tokens():
            assert held is not None and held.selection is not None
            raise ValueError(
                f"this KV cache layer holds only the {held.selection.slots} key/value group(s) per row that a condcomp "
                f"plan kept (of {held.num_kv_heads}); a call writing {key_states.shape[1]} key/value heads (the model "
                "under condcomp.disabled, or another model) cannot continue it: the skipped groups' keys were never "
                "computed. Continue the request with the wrapped model, or start a fresh cache for the dense model")
        return self.inner.update(key_states, value_states, *args, **kwargs)

    def reset(self) -> None:
        self.inner.reset()
        self.condcomp_plan = None
        self.condcomp_windows = None
        self.condcomp_executor = None

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (a negative count, transformers' form), or keep the first
        ``tokens_to_remove`` (a positive value: transformers' legacy absolute length; nothing when the layer holds no
        more), whatever the inner layer's own rule for positive values."""
        if torch.compiler.is_compiling():
            raise RuntimeError("a condcomp KV cache layer's crop() cannot run inside torch.compile: it reads the "
                               "tokens left on the host (a request's plan is dropped with its last token); crop "
                               "between compiled steps, as generate() does")
        if tokens_to_remove > 0:  # an absolute length: as a count, which every transformers layer takes
            tokens_to_remove = -max(self.held_tokens() - int(tokens_to_remove), 0)
            if tokens_to_remove == 0:
                return
        windows, policy = self.condcomp_windows, held_policy(self)
        if windows is not None and policy is not None:
            windows = policy.crop(windows, abs(tokens_to_remove))  # refused before anything changes
        self.inner.crop(tokens_to_remove)
        if windows is not self.condcomp_windows:  # set unchanged, it would still fail dynamo's guards on the layer
            self.condcomp_windows = windows
        if self.held_tokens() == 0:  # nothing left: the next call is a new request
            self.condcomp_plan = None
            self.condcomp_windows = None
            self.condcomp_executor = None

    def reorder_cache(self, beam_idx: Tensor) -> None:
        if self.held_position() is not None:  # preallocated storage: rows permuted in place, so its address (which
            for t in (self.inner.keys, self.inner.values):  # compiled steps and CUDA graphs read) is kept
                t.copy_(t.index_select(0, beam_idx.to(t.device)))
        else:
            self.inner.reorder_cache(beam_idx)
        self.take_rows(beam_idx)

    def batch_select_indices(self, indices: Tensor) -> None:
        self.inner.batch_select_indices(indices)
        self.take_rows(indices)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.inner.batch_repeat_interleave(repeats)
        if self.condcomp_plan is not None:
            rows = self.condcomp_plan.rows
            self.take_rows(torch.arange(rows, device=self.condcomp_plan.plan.gates.device).repeat_interleave(repeats))

    def take_rows(self, index: Tensor) -> None:
        """Keep the plan's and the policy state's rows ``index`` (the wrapped layer's rows are taken by its own
        operation)."""
        policy = held_policy(self)
        if self.condcomp_plan is not None:
            self.condcomp_plan = self.condcomp_plan.take_rows(index)
        if self.condcomp_windows is not None and policy is not None:
            self.condcomp_windows = policy.take_rows(self.condcomp_windows, index)
