"""RunConfig (everything one training run needs, JSON round-trip) and data preparation for it."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from condcomp.config import dataclass_from_dict
from condcomp.experiments import data as D
from condcomp.experiments.classification.batches import EncodedSplit
from condcomp.experiments.classification.model import ModelConfig, preset
from condcomp.experiments.classification.synthetic import make_synthetic, synthetic_vocab_size


@dataclass
class RunConfig:
    """One run: data, model shape, method, optimisation, measurement. Every field is a CLI flag too."""

    dataset: str = "synthetic"  # a staged name, "synthetic", "digits", "files" (train_file/test_file) or "hf:<name>"
    data_dir: str | None = None
    train_file: list[str] = field(default_factory=list)
    test_file: list[str] = field(default_factory=list)
    text_field: str = "text"
    pair_field: str | None = None
    label_field: str = "label"
    test_split: str = "test"  # for hf: datasets
    skip_bad_rows: bool = False
    tokenizer: str = "bert"
    max_len: int = 128
    max_train: int | None = None
    max_test: int | None = None
    test_seed: int | None = None  # seed of the --max-test subsample (None: seed + 1); a study fixes it
    synthetic_train: int = 6000
    synthetic_test: int = 1000
    synthetic_len: int = 24
    preset: str = "small"
    d_model: int | None = None
    num_layers: int | None = None
    num_heads: int | None = None
    d_ff: int | None = None
    dropout: float = 0.1
    pooling: str = "mean"
    method: str = "budgetformer"
    method_options: dict[str, Any] = field(default_factory=dict)
    budget_cost: float = 0.0  # extra loss budget_cost * mean(s) over layers: a compute price (0 = the paper's)
    budget_target: float = 0.0  # extra loss towards s from each example's loss rank (difficulty_target.py; 0 = off)
    epochs: int = 3
    max_steps: int | None = None
    batch_size: int = 32
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: float = 0.06
    seed: int = 0
    eval_batch_size: int = 128
    latency_reps: int = 20
    checkpoint_every: int = 0  # steps; 0 = only at the end
    carbon_country: str | None = None
    threads: int | None = None  # torch.set_num_threads; 1 is much faster on a loaded shared machine
    device: str = "cpu"  # where the model trains and runs ("cuda" on a GPU machine)

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "max_len", "eval_batch_size", "latency_reps"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        for name in ("dropout", "budget_cost", "budget_target", "lr", "weight_decay", "warmup"):
            if not math.isfinite(float(getattr(self, name))):  # a --config file may hold NaN or Infinity
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.budget_target < 0:
            raise ValueError(f"budget_target must be >= 0, got {self.budget_target}")
        if self.budget_target > 0 and self.method != "budgetformer":
            raise ValueError(f"--budget-target trains a learned budget towards each example's difficulty; method "
                             f"{self.method!r} has none (use --method budgetformer, or --budget-target 0)")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        return dataclass_from_dict(cls, d, "run config")  # type: ignore[no-any-return]

    @classmethod
    def from_file(cls, path: str | Path) -> RunConfig:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None


@dataclass
class PreparedDataset:
    """Encoded splits and what the model needs from the data."""

    train: EncodedSplit
    test: EncodedSplit
    vocab_size: int
    num_classes: int
    num_segments: int
    notes: dict[str, Any]


def _records(cfg: RunConfig, split: str) -> D.Records:
    files = cfg.train_file if split == "train" else cfg.test_file
    if cfg.dataset == "files" or files:
        if not files:
            raise ValueError(f"--dataset files needs --{split}-file")
        return D.load_files([Path(f) for f in files], cfg.text_field, cfg.pair_field, cfg.label_field,
                            cfg.skip_bad_rows)
    if cfg.dataset.startswith("hf:"):
        return D.load_hf(cfg.dataset[3:], "train" if split == "train" else cfg.test_split, cfg.text_field,
                         cfg.pair_field, cfg.label_field, cfg.skip_bad_rows)
    return D.load_named(cfg.dataset, D.resolve_data_dir(cfg.data_dir), split, cfg.skip_bad_rows)


def overlap(premise: str, hypothesis: str) -> float:
    """Fraction of the hypothesis' words found in the premise (a lexical difficulty proxy for NLI pairs)."""
    p = {w.strip(".,!?;:'\"").lower() for w in premise.split()}
    h = [w.strip(".,!?;:'\"").lower() for w in hypothesis.split()]
    return sum(w in p for w in h) / max(1, len(h))


def prepare(cfg: RunConfig, tokenizer: Any = None) -> tuple[PreparedDataset, Any]:
    """Load, subsample, tokenise; returns the prepared data and the tokenizer (None for synthetic)."""
    if cfg.dataset == "digits":
        from condcomp.experiments.classification.digit_tokens import prepare_digits

        d = prepare_digits(cfg.max_train, cfg.max_test)
        return PreparedDataset(d["train"], d["test"], d["vocab_size"], d["num_classes"], 1, d["notes"]), None
    if cfg.dataset == "synthetic":
        train = make_synthetic(cfg.synthetic_train, cfg.synthetic_len, seed=cfg.seed)
        test = make_synthetic(cfg.synthetic_test, cfg.synthetic_len, seed=cfg.seed + 10_000)
        return PreparedDataset(train, test, synthetic_vocab_size(), 4, 1, {"dataset": "synthetic"}), None
    from condcomp.experiments.classification.tokenize import encode, load_tokenizer, vocab_size

    tr = D.subsample(_records(cfg, "train"), cfg.max_train, cfg.seed)
    te = D.subsample(_records(cfg, "test"), cfg.max_test, cfg.seed + 1 if cfg.test_seed is None else cfg.test_seed)
    if not tr.labels or not te.labels:
        raise ValueError(f"{cfg.dataset}: empty split (train {len(tr.labels)}, test {len(te.labels)} rows)")
    num_classes = max(max(tr.labels), max(te.labels)) + 1
    if tokenizer is None:
        tokenizer = load_tokenizer(cfg.tokenizer, tr.texts + (tr.pairs or []))
    spec = D.DATASETS.get(cfg.dataset)
    notes = {"dataset": cfg.dataset, "note": spec.note if spec else "", "train_rows": len(tr.labels),
             "test_rows": len(te.labels), "skipped_rows": {"train": tr.skipped, "test": te.skipped},
             "sources": tr.sources + te.sources}
    train = encode(tokenizer, tr.texts, tr.pairs, tr.labels, cfg.max_len, notes)
    test = encode(tokenizer, te.texts, te.pairs, te.labels, cfg.max_len, notes)
    if te.pairs is not None:
        test.info = {**notes, "overlap": [overlap(a, b) for a, b in zip(te.texts, te.pairs)]}
    segs = 2 if tr.pairs is not None else 1
    return PreparedDataset(train, test, vocab_size(tokenizer), num_classes, segs, notes), tokenizer


def model_config(cfg: RunConfig, prep: PreparedDataset) -> ModelConfig:
    shape = preset(cfg.preset, d_model=cfg.d_model, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
                   d_ff=cfg.d_ff)
    shape["max_len"] = max(shape["max_len"], cfg.max_len, prep.train.ids.shape[1], prep.test.ids.shape[1])
    return ModelConfig(vocab_size=prep.vocab_size, num_classes=prep.num_classes, num_segments=prep.num_segments,
                       dropout=cfg.dropout, pooling=cfg.pooling, **shape)


def seed_everything(seed: int) -> None:
    torch.manual_seed(seed)


# --- a run's identity -------------------------------------------------------------------------------------

# Settings that change neither what a run learns nor what it is scored on: a finished run is reused whatever
# their value. Every other field is part of the run's identity.
NOT_IDENTITY = frozenset({"threads", "checkpoint_every", "data_dir", "device", "carbon_country", "latency_reps"})


def identity_differences(expected: dict[str, Any], found: dict[str, Any], varies: Iterable[str] = ()) -> list[str]:
    """The identity fields where ``found`` (a run's saved settings) differs from ``expected``, as
    ``"max_steps 40 there, 20 now"``; fields absent from ``found`` (older records) and ``varies`` are skipped."""
    skip = NOT_IDENTITY | set(varies)
    return [f"{k} {found[k]!r} there, {v!r} now" for k, v in expected.items()
            if k not in skip and k in found and found[k] != v]


def check_same_settings(expected: RunConfig, runs: Iterable[tuple[str, dict[str, Any], Iterable[str]]],
                        fresh_hint: str) -> None:
    """Refuse, before anything runs, when finished runs that a command would reuse or combine were made with
    other settings. ``runs``: (run folder, its saved settings, the fields allowed to differ for that run)."""
    want = expected.to_dict()
    bad = [(label, diff) for label, found, varies in runs if (diff := identity_differences(want, found, varies))]
    if not bad:
        return
    shown = "\n".join(f"  {label}: {'; '.join(diff)}" for label, diff in bad[:8])
    more = f"\n  (and {len(bad) - 8} more)" if len(bad) > 8 else ""
    raise ValueError(f"{len(bad)} finished run(s) were made with other settings; a run's settings are part of its "
                     f"identity, so they are neither reused nor combined with runs of these settings:\n{shown}{more}\n"
                     f"Rerun with their settings, or start fresh: {fresh_hint}")


def changed_settings(saved: dict[str, Any], now: RunConfig) -> list[str]:
    """The settings where a finished run's saved ``config`` differs from ``now``. A field the saved config lacks
    was added to :class:`RunConfig` after that run: it ran with the field's default, so only a non-default value
    now counts as a change."""
    want = now.to_dict()
    defaults = {f.name: (f.default_factory() if f.default_factory is not MISSING else f.default)
                for f in fields(RunConfig)}
    return sorted(k for k, v in want.items() if saved.get(k, defaults.get(k)) != v)
