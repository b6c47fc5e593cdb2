"""A per-request full/window KV split: one ``topk`` router per layer picks, from each request's own input, which KV
group(s) keep the full cache; the others keep a streaming window (``sinks`` first + ``window`` last tokens).

The static splits of ``condcomp bench kv`` (``split-static-1of3``, ``split-duo-1of3``) are the same routers with
scorer weights 0: every request gets the same groups. Here the scorer (a linear layer on the layer's input, pooled
over the request's real tokens, as at inference) is trained with DuoAttention's objective: the model frozen, the
gated model's last hidden states matched to the dense model's (:func:`~condcomp.kv.duo_gates
.distill_loss`). Each layer's router runs in training mode on its attention input (a forward pre-hook) and its
plan's gates ``(B, H)`` become the rows' gates of :func:`~condcomp.kv.duo_attention.duo_attention`:
straight-through, so the forward is the hard top-k split inference uses (gate 1 = full, 0 = window) and the
gradient is the soft mask's. Warm start (``init_scores``): the scorer starts at the static split's ranking, so the
untrained router is ``split-static-1of3`` exactly.

The result is a router file (:func:`save_router` / :func:`load_router`): per layer, the scorer's state dict, with
the model's shape and the settings (``torch.save``; loadable with ``weights_only=True``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from condcomp.kv.duo_attention import RowGates, attention_modules, gated, real_positions
from condcomp.kv.duo_gates import distill_loss, hidden_states, train_loop
from condcomp.types import Budget

FORMAT = "condcomp-kv-request-router/1"


@dataclass(frozen=True)
class RequestSettings:
    """One router training run: Adam's ``lr`` on the scorers, ``keep`` KV groups per layer kept in full."""

    steps: int = 100
    seq_len: int = 768
    lr: float = 1e-3
    keep: int = 1
    sinks: int = 4
    window: int = 252
    seed: int = 0
    init: str = "importance"

    def check(self, groups: int) -> None:
        if self.steps < 1:
            raise ValueError(f"--steps must be >= 1, got {self.steps}")
        if self.seq_len <= self.sinks + self.window:
            raise ValueError(f"--seq-len {self.seq_len} must exceed sinks + window = {self.sinks + self.window}: "
                             "shorter sequences attend identically under both patterns and train nothing")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not 1 <= self.keep < groups:
            raise ValueError(f"a per-request split keeps 1 to {groups - 1} of the {groups} KV groups, got {self.keep}")


def model_shape(model: nn.Module) -> tuple[int, int, int, int]:
    """``(layers, query heads, KV groups, d_model)`` of a Llama-style causal LM."""
    cfg: Any = getattr(model, "config")  # noqa: B009
    H = int(cfg.num_attention_heads)
    return (int(cfg.num_hidden_layers), H, int(getattr(cfg, "num_key_value_heads", 0) or H), int(cfg.hidden_size))


class RequestSplit(nn.Module):
    """One ``topk`` router per layer (``kv_groups``, a streaming window for the unchosen groups) and the budget:
    ``keep`` groups of ``groups`` per row. ``init_scores``: per layer, the warm start (one score per group)."""

    def __init__(self, d_model: int, heads: int, groups: int, init_scores: Sequence[Sequence[float]], keep: int = 1,
                 sinks: int = 4, window: int = 252) -> None:
        super().__init__()
        from condcomp.routers.topk import TopKRouter

        if heads % groups:
            raise ValueError(f"{heads} query heads do not split into {groups} KV groups")
        self.heads, self.groups, self.keep, self.sinks, self.window = heads, groups, keep, sinks, window
        self.routers = nn.ModuleList(
            TopKRouter(d_model, heads, kv_groups=True, num_kv_heads=groups, init_scores=list(init))
            for init in init_scores)  # the window is the split's (routed(), and kv="window" when applied)

    def budget(self, rows: int, device: torch.device) -> Budget:
        """``keep`` groups per row, as heads (the router keeps ``ceil(k / r)`` groups of ``r`` heads)."""
        k = self.keep * (self.heads // self.groups)
        return Budget(s=torch.full((rows,), self.keep / self.groups, device=device),
                      k=torch.full((rows,), k, dtype=torch.long, device=device))

    def set_progress(self, progress: float) -> None:
        for router in self.routers:
            router.set_progress(progress)  # type: ignore[operator]

    def gates(self, layer: int, x: Tensor, real: Tensor | None) -> Tensor:
        """``(B, H)`` the layer's plan gates for input ``x (B, T, D)`` with real tokens ``real (B, T)``: training
        mode, the straight-through top-k (1 = full, 0 = window); eval, the hard top-k."""
        router = self.routers[layer]
        return router(x, real, self.budget(x.shape[0], x.device), None).gates  # type: ignore[no-any-return]

    def kept(self, gates: RowGates) -> Tensor:
        """``(B, L, keep)`` the groups each row kept in full per layer (ascending), from the rows' gates of the last
        forward under :func:`routed`."""
        r = self.heads // self.groups
        on = torch.stack([g.detach()[:, ::r] for g in gates.rows], dim=1)  # type: ignore[union-attr]  # (B, L, G)
        return on.topk(self.keep, -1).indices.sort(-1).values

    @torch.no_grad()
    def choices(self, model: nn.Module, ids: Tensor, mask: Tensor | None = None) -> Tensor:
        """``(B, L, keep)`` the groups each row of ``ids (B, T)`` (real tokens: ``mask``) keeps in full per layer
        at inference (eval: hard top-k of the scores)."""
        was = self.training
        self.eval()
        try:
            with routed(model, self) as gates:
                getattr(model, "base_model", model)(input_ids=ids, attention_mask=mask, use_cache=False)
            return self.kept(gates)
        finally:
            self.train(was)


@contextmanager
def routed(model: nn.Module, split: RequestSplit) -> Iterator[RowGates]:
    """Within the block each layer's attention mixes full and window attention per row by the layer's router,
    which sees the layer's input pooled over the row's real tokens; yields the rows' gates of the last forward."""
    modules = attention_modules(model)
    if len(modules) != len(split.routers):
        raise ValueError(f"the router file holds {len(split.routers)} layers, the model has {len(modules)}")
    gates = RowGates(len(modules), split.sinks, split.window)

    def hook(layer: int) -> Callable[..., None]:
        def pre(_: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # (B, T, D)
            B, T = x.shape[:2]
            real = real_positions(kwargs.get("attention_mask"), B, T, x.device) >= 0  # (B, T)
            # The router decides from the input; the gradient reaches it through its own gates only (not through
            # earlier layers' choices moving its input).
            gates.rows[layer] = split.gates(layer, x.detach(), real)
        return pre

    handles = [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(modules)]
    try:
        with gated(model, gates):
            yield gates
    finally:
        for h in handles:
            h.remove()


def train_router(model: nn.Module, rows: Sequence[Sequence[int]], settings: RequestSettings,
                 init_scores: Sequence[Sequence[float]], checkpoint: Path | None = None,
                 on_step: Callable[[int, float, float], None] | None = None) -> tuple[RequestSplit, list[list[float]]]:
    """Routers trained for ``settings.steps`` steps (one row each), and the history ``[step, distillation, share
    of layers whose choice left the warm start]``. Loss: the distillation alone (the budget is fixed)."""
    L, H, G, D = model_shape(model)
    settings.check(G)
    torch.manual_seed(settings.seed)
    device = next(model.parameters()).device
    split = RequestSplit(D, H, G, init_scores, settings.keep, settings.sinks, settings.window).to(device).train()
    start = torch.tensor([list(s) for s in init_scores]).topk(settings.keep, -1).indices.sort(-1).values.to(device)
    opt = torch.optim.Adam(split.parameters(), lr=settings.lr)

    def step_fn(step: int, ids: Tensor) -> tuple[float, float]:
        split.set_progress(step / settings.steps)  # the routers' temperature and noise schedules
        with torch.no_grad():
            teacher = hidden_states(model, ids)
        with routed(model, split) as gates:
            student = hidden_states(model, ids)
        loss = distill_loss(student, teacher)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        moved = (split.kept(gates)[0] != start).any(-1).float().mean()  # layers off the warm start
        return float(loss.detach()), float(moved)

    # the schedules run over the planned steps: a run resumes only with the same number of steps
    record = {**asdict(settings), "schedule_steps": settings.steps}
    history = train_loop(model, split, opt, rows, record, step_fn, checkpoint, on_step,
                         command="calibrate-kv --method request")
    return split.eval(), history


def save_router(path: Path, split: RequestSplit, model_name: str, model: nn.Module, settings: dict[str, Any],
                history: list[list[float]]) -> None:
    """Write a router file: each layer's scorer state dict with the model's shape, the split and the settings."""
    L, H, G, D = model_shape(model)
    record = {"format": FORMAT, "model": model_name, "layers": L, "heads": H, "kv_groups": G, "d_model": D,
              "keep": split.keep, "sinks": split.sinks, "window": split.window, "settings": settings,
              "history": history,
              "scorers": [{k: v.detach().cpu().clone() for k, v in r.scorer.state_dict().items()}  # type: ignore
                          for r in split.routers]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(record, tmp)
    tmp.replace(path)


def load_router(path: Path, model: nn.Module) -> RequestSplit:
    """The routers of a router file, checked against ``model``'s shape; clear errors when the file cannot be used."""
    from condcomp.files import FileError, check_state_shapes, int_field, read_torch_dict, tensor_dict

    hint = f"write it with `condcomp calibrate-kv --method request --out {path}` (docs/kv-calibration.md, 'A " \
           "per-request split')"
    record = read_torch_dict(path, "a condcomp per-request router file", hint)
    if record.get("format") != FORMAT:
        raise FileError(f"{path} is not a condcomp per-request router file (format {record.get('format')!r}, "
                        f"expected {FORMAT!r}); {hint}")
    L, H, G, D = model_shape(model)
    saved = tuple(record.get(k) for k in ("layers", "heads", "kv_groups", "d_model"))
    scorers = record.get("scorers")
    if not isinstance(scorers, list):
        raise FileError(f"{path}: field 'scorers' must be a list of state dicts, one per layer, found "
                        f"{type(scorers).__name__}; {hint}")
    if saved != (L, H, G, D) or len(scorers) != L:
        raise FileError(f"{path} holds routers for (layers, heads, KV groups, d_model) = {saved} ({len(scorers)} "
                        f"scorers); this model is {(L, H, G, D)}: train a router file for this model ({hint})")
    for name, low, high in (("keep", 1, G - 1), ("sinks", 0, None), ("window", 1, None)):  # int(3.7) would pass
        int_field(record, name, path, hint, low, high)
    states = [tensor_dict(state, path, f"scorers[{i}]", hint) for i, state in enumerate(scorers)]
    bad = [i for i, state in enumerate(states) if not all(bool(t.isfinite().all()) for t in state.values())]
    if bad:  # a NaN score would pick groups arbitrarily
        raise FileError(f"{path}: the routers of layer(s) {bad} hold non-finite weights: train the file again")
    split = RequestSplit(D, H, G, [[0.0] * G] * L, record["keep"], record["sinks"], record["window"])
    for i, (router, state) in enumerate(zip(split.routers, states)):
        scorer: Any = router.scorer
        check_state_shapes(path, f"scorers[{i}]", state, scorer.state_dict(), hint)
        scorer.load_state_dict(state)
    return split.eval()
