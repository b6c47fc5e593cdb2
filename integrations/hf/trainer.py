"""``CondCompCallback``: condcomp's training side channels wired into ``transformers.Trainer``.

With ``Trainer(..., callbacks=[CondCompCallback()])`` and nothing else:

- the loss Trainer optimizes is the task loss + ``condcomp.aux_loss(model)`` (budget hinge, entropy, load
  balance): a forward hook adds the auxiliary loss to ``outputs.loss`` of every training forward, the way
  transformers' MoE models add their router loss inside the model (so DDP, gradient accumulation and mixed
  precision see one loss, as they do for those models). The model must compute its loss (labels in the batch);
  a training forward without ``loss`` is warned about once;
- under gradient accumulation each micro-batch's auxiliary loss gets the weight transformers gives that
  micro-batch's task loss, so a step's auxiliary term is a mean, as its task loss is: for a model that takes loss
  kwargs (Trainer passes ``num_items_in_batch`` and does not divide) the micro-batch's share of the step's label
  count, counted as Trainer counts it; for one that does not, nothing here, since Trainer divides the whole loss
  by the number of micro-batches. (A model whose forward takes ``**kwargs`` but ignores ``num_items_in_batch``,
  such as ``BertForSequenceClassification``, gets an undivided task loss from Trainer itself; set
  ``model.accepts_loss_kwargs = False`` before building the Trainer to have both terms averaged.)
- ``condcomp.set_progress`` follows ``global_step / max_steps`` (temperature, noise, entropy schedules), and is
  1.0 when training ends;
- every log gets the head usage of the last forward (means over the routed layers; ``per_layer=True`` adds one
  entry per layer): ``condcomp/s_mean`` (the predicted budget s), ``condcomp/budget_k_frac`` (the fraction of
  heads that budget allows, ``k = floor(s H)``: what an eval forward computes), ``condcomp/k_frac`` and
  ``condcomp/flop_frac`` (what the last forward computed). During BudgetFormer training ``k_frac`` is 1 and
  ``flop_frac`` slightly above 1: training computes every head with soft top-k weights (plus the routing), so read
  ``s_mean`` and ``budget_k_frac`` there. They go into ``state.log_history`` (``trainer_state.json``) and reach
  the callbacks after this one.

>>> trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[CondCompCallback()])  # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor, nn
from transformers import TrainerCallback

from condcomp.api import aux_loss, head_usage, routing_hosts, set_progress
from condcomp.host import RoutingHost
from condcomp.plans import budget_k


class CondCompCallback(TrainerCallback):  # type: ignore[misc]
    """Adds ``condcomp.aux_loss`` to the training loss, steps the schedules, logs head usage."""

    def __init__(self, per_layer: bool = False) -> None:
        self.per_layer = per_layer
        self._hook: Any = None
        self._warned = False
        self._warned_count = False
        self._accumulation = 1

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       **kwargs: Any) -> None:
        if model is None or not routing_hosts(model):
            raise ValueError("CondCompCallback: the Trainer's model has no condcomp routing; call "
                             "condcomp.apply_(model, cfg) before building the Trainer")
        if self._hook is not None:
            self._hook.remove()
        self._hook = model.register_forward_hook(self._add_aux_loss, with_kwargs=True)
        self._accumulation = max(1, int(getattr(args, "gradient_accumulation_steps", 1) or 1))
        set_progress(model, _progress(state))

    def on_step_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                      **kwargs: Any) -> None:
        if model is not None:
            set_progress(model, _progress(state))

    def on_train_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                     **kwargs: Any) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if model is not None:
            set_progress(model, 1.0)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               model: nn.Module | None = None, **kwargs: Any) -> None:
        if model is None or logs is None:
            return
        usage = head_usage(model)
        if not usage:
            return
        hosts = routing_hosts(model)
        table: dict[str, dict[str, float | None]] = {
            name: {"s_mean": u.s_mean, "budget_k_frac": _budget_k_frac(hosts[name]) if name in hosts else None,
                   "k_frac": u.k_frac, "flop_frac": u.flop_frac} for name, u in usage.items()}
        extra: dict[str, float] = {}
        for field in ("s_mean", "budget_k_frac", "k_frac", "flop_frac"):
            values = {name: v for name, row in table.items() if (v := row[field]) is not None}
            if values:
                extra[f"condcomp/{field}"] = sum(values.values()) / len(values)
            if self.per_layer:
                extra.update({f"condcomp/{name}/{field}": v for name, v in values.items()})
        logs.update(extra)
        # Trainer appended this log to its history before calling the callbacks: complete that entry too.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(extra)

    def _add_aux_loss(self, module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        if not module.training:
            return None
        loss = output.get("loss") if isinstance(output, dict) else None
        if loss is None and isinstance(output, tuple) and output and getattr(output[0], "dim", None) is not None:
            if output[0].dim() == 0:  # return_dict=False: (loss, logits, ...)
                return (output[0] + self._scaled_aux(module, kwargs, output[0]), *output[1:])
        if loss is None:
            if not self._warned:
                self._warned = True
                warnings.warn("CondCompCallback: a training forward returned no loss (no labels in the batch?), so "
                              "condcomp.aux_loss could not be added; the budget and balance terms are not trained",
                              stacklevel=2)
            return None
        output["loss"] = loss + self._scaled_aux(module, kwargs, loss)
        return output

    def _scaled_aux(self, module: nn.Module, kwargs: dict[str, Any], loss: Tensor) -> Tensor:
        """``aux_loss(module)`` times the weight Trainer's loss scaling gives this micro-batch's task loss."""
        aux = aux_loss(module)
        total = kwargs.get("num_items_in_batch")
        if total is None:  # Trainer divides the whole loss by the number of micro-batches itself
            return aux
        items = _label_count(module, kwargs)
        if items is None:
            if not self._warned_count:
                self._warned_count = True
                warnings.warn("CondCompCallback: the forward got num_items_in_batch but no labels to count this "
                              "micro-batch's share with; the auxiliary loss is divided by "
                              "gradient_accumulation_steps instead", stacklevel=3)
            return aux / self._accumulation
        total_t = torch.as_tensor(total, device=loss.device, dtype=torch.float32).reshape(-1)[0]
        share = items.to(device=loss.device, dtype=torch.float32) / total_t.clamp_min(1.0)
        return aux * share.to(aux.dtype)


def _label_count(module: nn.Module, kwargs: dict[str, Any]) -> Tensor | None:
    """The micro-batch's label count as Trainer counts it for ``num_items_in_batch`` (causal LMs: shifted)."""
    labels = kwargs.get("shift_labels")
    if labels is None:
        labels = kwargs.get("labels")
        if not isinstance(labels, Tensor):
            return None
        if _loss_shifts_labels(module):
            labels = labels[..., 1:]
    if not isinstance(labels, Tensor):
        return None
    return labels.ne(-100).sum()


def _loss_shifts_labels(module: nn.Module) -> bool:
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss

    config = getattr(module, "config", None)
    return (LOSS_MAPPING.get(str(getattr(module, "loss_type", ""))) is ForCausalLMLoss
            and not getattr(config, "is_encoder_decoder", False))


def _budget_k_frac(host: RoutingHost) -> float | None:
    """Mean over real rows of ``k / H`` with ``k`` the policy's budget rule applied to the last forward's s."""
    last = host.last
    if last is None:
        return None
    policy = host.condcomp_policy
    s = last.s.float()
    if s.dim() == 2 and last.mask is not None:  # per-token budgets: real tokens only
        s = s[last.mask.bool()]
    if not s.numel():
        return None
    H = host.layout.num_heads
    k = budget_k(s, H, int(getattr(policy, "k_min", 1)), getattr(policy, "rounding", "floor"))
    return float(k.float().mean()) / H


def _progress(state: Any) -> float:
    return min(1.0, state.global_step / state.max_steps) if state.max_steps else 0.0
