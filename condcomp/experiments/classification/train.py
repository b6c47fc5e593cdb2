"""Training and evaluation of the encoder classifier with any condcomp method; checkpoints and resume.

``loss = cross_entropy + condcomp.aux_loss(model)`` (+ the run's price on heads and difficulty target);
``condcomp.set_progress(model, step / total)`` every step
(steps the temperature / noise / entropy schedules).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import condcomp
from condcomp.api import routed_modules
from condcomp.experiments.classification.batches import EncodedSplit, on_device
from condcomp.experiments.classification.convergence import PlateauCheck
from condcomp.experiments.classification.difficulty_target import difficulty_target_loss
from condcomp.experiments.classification.methods import method_config
from condcomp.experiments.classification.metrics import layer_plan_stats
from condcomp.experiments.classification.model import EncoderClassifier, ModelConfig
from condcomp.experiments.classification.runconfig import RunConfig
from condcomp.experiments.divergence import flags, stop_if_diverged
from condcomp.experiments.progress import progress_bar


def build_model(mcfg: ModelConfig, cfg: RunConfig) -> EncoderClassifier:
    """The dense classifier made routed with the run's method (routing parameters from torch's generator)."""
    model = EncoderClassifier(mcfg)
    condcomp.apply_(model, method_config(cfg.method, mcfg.num_heads, cfg.method_options,
                                         num_layers=mcfg.num_layers))
    if cfg.method == "fixed_layers":
        from condcomp.experiments.classification.layer_budget import install_layer_means

        install_layer_means(model, {k: float(v) for k, v in cfg.method_options["heads"].items()})
    return model.to(torch.device(cfg.device))


def total_steps(cfg: RunConfig, n_train: int) -> int:
    per_epoch = math.ceil(n_train / cfg.batch_size)
    steps = cfg.epochs * per_epoch
    return min(steps, cfg.max_steps) if cfg.max_steps else steps


def make_optimizer(model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "condcomp_" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "condcomp_" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": rest, "weight_decay": 0.0}], lr=cfg.lr)


def make_scheduler(opt: torch.optim.Optimizer, cfg: RunConfig, steps: int, done: int) -> Any:
    """Linear warm-up then linear decay; ``done`` steps already taken (resume: the lr continues, not restarts)."""
    warm = max(1, int(cfg.warmup * steps))
    if done:
        for group in opt.param_groups:
            group.setdefault("initial_lr", cfg.lr)
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, max(0.0, (steps - s) / max(1, steps - warm))), last_epoch=done - 1)


def train(model: EncoderClassifier, split: EncodedSplit, cfg: RunConfig, ckpt_dir: Path | None = None,
          resume: bool = False, meta: dict[str, Any] | None = None, desc: str = "train",
          plateau: PlateauCheck | None = None) -> dict[str, Any]:
    """Train in place; returns the train state (steps, final loss, seconds, ``convergence``: the verdict of
    ``plateau``, default ``PlateauCheck()``, on the loss of every step). Checkpoints into ``ckpt_dir`` (with the
    loss history, so that a resumed run's verdict covers every step)."""
    from condcomp.checkpoint import save_checkpoint
    from condcomp.resume import capture_rng, restore_rng

    steps = total_steps(cfg, len(split))
    per_epoch = math.ceil(len(split) / cfg.batch_size)
    opt = make_optimizer(model, cfg)
    state, rng = _start_state(model, opt, steps, ckpt_dir, resume, meta or {})
    history = state.pop("loss_history", None)  # the losses of the steps before a resume
    losses: list[float] = [] if history is None else [float(v) for v in history.tolist()]
    sched = make_scheduler(opt, cfg, steps, int(state["step"]))
    if rng is not None:
        restore_rng(rng)  # last: nothing above may draw from the restored streams
    model.train()
    device = next(model.parameters()).device
    t0 = time.perf_counter() - float(state["seconds"])

    def save() -> None:
        if ckpt_dir is not None:
            st = {**state, "seconds": time.perf_counter() - t0, "rng": capture_rng(),
                  "loss_history": torch.tensor(losses, dtype=torch.float64)}
            save_checkpoint(ckpt_dir, model, meta or {}, opt, st)

    # each routed layer's budget of the forward (policy, s), for the price on heads and the difficulty target
    budgets: list[tuple[Any, Tensor]] = []  # Any: the policy, whatever its class
    wanted = cfg.budget_cost > 0 or cfg.budget_target > 0
    hooks = [r.condcomp_policy.register_forward_hook(lambda m, a, out: budgets.append((m, out.s)))
             for r in routed_modules(model).values()] if wanted else []
    bar = progress_bar(total=steps, initial=state["step"], desc=desc)
    while state["step"] < steps:
        epoch = state["step"] // per_epoch
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)  # same order when resumed mid-epoch
        skip = state["step"] - epoch * per_epoch
        for i, batch in enumerate(split.batches(cfg.batch_size, shuffle=True, generator=g)):
            if i < skip:
                continue
            condcomp.set_progress(model, state["step"] / steps)
            state["loss"] = _train_step(model, on_device(batch, device), opt, sched, cfg, budgets)
            stop_if_diverged(state["step"] + 1, {"loss": state["loss"]}, model.parameters(),
                             flags(vars(cfg), "lr", "budget_cost", "budget_target"))
            losses.append(state["loss"])
            state["step"] += 1
            state["epoch"] = epoch
            bar.update(1, loss=state["loss"])
            if cfg.checkpoint_every and state["step"] % cfg.checkpoint_every == 0:
                save()
            if state["step"] >= steps:
                break
    bar.close()
    for h in hooks:
        h.remove()
    state["seconds"] = time.perf_counter() - t0
    state["convergence"] = (plateau or PlateauCheck()).verdict(losses)
    condcomp.set_progress(model, 1.0)  # before the save: the final checkpoint is the trained model, schedules done
    save()
    model.eval()
    return state


def _start_state(model: EncoderClassifier, opt: torch.optim.Optimizer, steps: int, ckpt_dir: Path | None,
                 resume: bool, meta: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The train state to start from and the random state to restore last: fresh, or ``--resume``'s checkpoint
    (model and optimiser loaded in place; refused, each difference named, when made with other settings)."""
    from condcomp.checkpoint import load_checkpoint, read_checkpoint_config
    from condcomp.experiments.classification.runconfig import NOT_IDENTITY
    from condcomp.resume import ResumeError, check_settings

    state: dict[str, Any] = {"step": 0, "epoch": 0, "loss": None, "seconds": 0.0, "total_steps": steps}
    if not resume:
        return state, None
    if ckpt_dir is None or not (ckpt_dir / "condcomp.json").is_file():
        raise FileNotFoundError(f"--resume: no checkpoint in {ckpt_dir}")
    saved = read_checkpoint_config(ckpt_dir)
    check_settings(ckpt_dir, {**saved.get("run", {}), "model": saved.get("model")},
                   {**meta.get("run", {}), "model": meta.get("model")}, may_differ=NOT_IDENTITY)
    loaded = load_checkpoint(ckpt_dir, model, opt)
    state.update(loaded.get("train_state") or {})
    state["total_steps"] = steps
    if "rng" not in state:
        raise ResumeError(f"{ckpt_dir} was written by an older condcomp that kept torch's generator only; resuming "
                          f"it would not continue the same run: delete {ckpt_dir} to train from the start")
    return state, state.pop("rng")


def _train_step(model: EncoderClassifier, batch: tuple[Tensor, Tensor, Tensor | None, Tensor],
                opt: torch.optim.Optimizer, sched: Any, cfg: RunConfig,
                budgets: list[tuple[Any, Tensor]]) -> float:
    """One optimiser step: task loss + auxiliary losses (+ ``budget_cost`` * the mean budget of this forward,
    + ``budget_target`` * the difficulty-target loss; budgets collected by the policies' hooks); returns the loss."""
    ids, mask, seg, labels = batch
    logits = model(ids, mask, seg)
    loss = F.cross_entropy(logits, labels) + condcomp.aux_loss(model)
    if budgets:
        if cfg.budget_cost > 0:
            loss = loss + cfg.budget_cost * torch.stack([s.float().mean() for _, s in budgets]).mean()
        if cfg.budget_target > 0:
            example_loss = F.cross_entropy(logits.detach(), labels, reduction="none")  # (B,), ranks only
            interval = [(float(p.s_min), float(p.s_max), s) for p, s in budgets if hasattr(p, "s_min")]
            loss = loss + cfg.budget_target * difficulty_target_loss(interval, example_loss)
        budgets.clear()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return float(loss.detach())


@torch.no_grad()
def evaluate(model: EncoderClassifier, split: EncodedSplit, batch_size: int = 128,
             desc: str | None = None) -> dict[str, Any]:
    """Accuracy, per-layer usage, per-head selection frequency (``head_freq``: layer -> H fractions) and
    per-example budget/heads/correctness/prediction/loss/length over a split (eval mode)."""
    model.eval()
    correct: list[Tensor] = []
    prob_true: list[Tensor] = []
    preds: list[Tensor] = []
    losses: list[Tensor] = []
    lengths: list[Tensor] = []
    per_layer: dict[str, list[dict[str, Tensor]]] = {n: [] for n in routed_modules(model)}
    bar = progress_bar(total=math.ceil(len(split) / batch_size), desc=desc) if desc else None
    device = next(model.parameters()).device
    for batch in split.batches(batch_size):
        ids, mask, seg, labels = on_device(batch, device)
        logits = model(ids, mask, seg).float()
        correct.append(logits.argmax(-1) == labels)
        preds.append(logits.argmax(-1))
        logp = logits.double().log_softmax(-1).gather(1, labels[:, None]).squeeze(1)
        prob_true.append(logp.exp().float())
        losses.append(-logp)
        lengths.append(mask.sum(1))
        for name, r in routed_modules(model).items():
            per_layer[name].append(layer_plan_stats(r))
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    stats = {n: {k: torch.cat([b[k] for b in v]) for k in v[0]} for n, v in per_layer.items() if v}
    ok = torch.cat(correct)
    s_ex = torch.stack([st["s"] for st in stats.values()]).mean(0)  # (N,) mean over layers
    k_ex = torch.stack([st["k_frac"] for st in stats.values()]).mean(0)
    out: dict[str, Any] = {
        "accuracy": float(ok.float().mean()),
        "n": len(split),
        "s_mean": float(s_ex.mean()),
        "k_frac": float(k_ex.mean()),
        "layers": {n: {"s_mean": float(st["s"].mean()), "k_frac": float(st["k_frac"].mean())}
                   for n, st in stats.items()},
        "head_freq": {n: st["head_frac"].mean(0).tolist() for n, st in stats.items()},
        "examples": {"s": s_ex.tolist(), "k_frac": k_ex.tolist(), "correct": ok.tolist(),
                     "prob_true": torch.cat(prob_true).tolist(), "pred": torch.cat(preds).tolist(),
                     "loss": torch.cat(losses).tolist(), "length": torch.cat(lengths).tolist()},
        "_stats": stats,
    }
    out["examples"]["layers"] = {n: per_example_layer(st, routed_modules(model)[n].layout.num_heads)
                                 for n, st in stats.items()}
    if split.tags is not None:
        out["by_tag"] = group_stats(split.tags, s_ex, k_ex, ok)
    return out


def per_example_layer(st: dict[str, Tensor], num_heads: int) -> dict[str, list[Any]]:
    """One layer's per-example budget ``s``, head count ``k`` and, where every example runs whole heads (sequence
    routing), ``heads``: the set of heads it ran as a bit mask (bit h = head h)."""
    out: dict[str, list[Any]] = {"s": st["s"].tolist(), "k": (st["k_frac"] * num_heads).round().long().tolist()}
    hf = st["head_frac"]  # (N, H)
    if bool(((hf == 0) | (hf == 1)).all()):
        bits = 2 ** torch.arange(num_heads, dtype=torch.long)
        out["heads"] = (hf.long() * bits).sum(1).tolist()
    return out


def group_stats(groups: list[str], s: Tensor, k: Tensor, ok: Tensor) -> dict[str, dict[str, float]]:
    """Mean budget, realised heads and accuracy per group label."""
    out = {}
    for g in sorted(set(groups)):
        idx = torch.tensor([x == g for x in groups])
        out[g] = {"n": int(idx.sum()), "s_mean": float(s[idx].mean()), "k_frac": float(k[idx].mean()),
                  "accuracy": float(ok[idx].float().mean())}
    return out
