"""Train a routed model with DDP or FSDP2 on several GPUs (or CPU processes), launched by torchrun.

    torchrun --nproc_per_node 8 examples/train_ddp.py --mode ddp --steps 100 --out runs/ddp
    torchrun --nproc_per_node 8 examples/train_ddp.py --mode fsdp2 --steps 100 --out runs/fsdp2
    python -m torch.distributed.run --nproc_per_node 2 --standalone examples/train_ddp.py --steps 5   # CPU, gloo

What routing changes for distributed training (tests/test_distributed.py checks each point against
single-process training on the same global batch):

1. **Return the auxiliary loss from the wrapped forward.** With ``find_unused_parameters=True`` DDP walks the
   autograd graph from the forward's *outputs*; a budget policy whose parameters reach the loss only through
   ``condcomp.aux_loss`` (the budget hinge) would be declared unused and then get a gradient anyway ("Expected
   to mark a variable ready only once"). ``WithAux`` below returns ``(logits, aux)``.
2. **DDP: ``find_unused_parameters=True``** when a router can leave some parameter out of the graph on one rank
   (per-head parameters touched only for selected heads, or an executor that skips every projection when all
   of a rank's examples get k = 0). Without it DDP stops with "Expected to have finished reduction in the prior
   iteration". ``static_graph=True`` is *not* a substitute: it assumes the same unused set on every rank and
   every step, and with rank-dependent routing it hung until the process-group timeout in our runs.
   condcomp's built-in routers keep their parameters in the graph (zero gradients for unselected heads), so
   for them plain DDP also works; the flag costs one graph traversal per step.
3. **FSDP2 (``fully_shard``): every parameter must receive a gradient on every rank.** FSDP2 reduce-scatters
   only the gradients a rank has; if ranks differ, the collective is mismatched: it either aborts ("Received data
   size doesn't match expected size") or, when the sizes happen to agree, silently mixes up gradients (we
   measured parameters 4e-3 off after 3 steps). Routers must multiply unused parameters by zero rather than skip
   them. A policy shared by all layers (``share_policy=True``) belongs to the root unit: pass its parameters as
   ``ignored_params`` when sharding each layer. FSDP2 also rejects 0-dim parameters: use shape ``(1,)``.

HF Accelerate: ``accelerator.prepare(model)`` wraps in DDP; pass
``DistributedDataParallelKwargs(find_unused_parameters=True)`` through ``kwargs_handlers`` and keep point 1
(compute ``condcomp.aux_loss`` inside the module's forward). Its FSDP2 plugin has the same requirement as point 3.
Call ``condcomp.apply_`` *before* ``prepare``/``fully_shard``, so the routing parameters are wrapped and sharded
with the rest; ``condcomp.set_progress(model, p)`` works on the unwrapped module (``accelerator.unwrap_model``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import condcomp


class Encoder(nn.Module):
    """A small text-classifier-shaped encoder: embeddings, routed attention + MLP blocks, mean pooling."""

    def __init__(self, vocab: int = 1000, d_model: int = 128, heads: int = 8, layers: int = 4, classes: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.attn = nn.ModuleList([condcomp.HeadAttention(d_model, heads) for _ in range(layers)])
        self.mlp = nn.ModuleList([nn.Sequential(nn.LayerNorm(d_model), nn.Linear(d_model, 4 * d_model), nn.GELU(),
                                                nn.Linear(4 * d_model, d_model)) for _ in range(layers)])
        self.norm = nn.ModuleList([nn.LayerNorm(d_model) for _ in range(layers)])
        self.head = nn.Linear(d_model, classes)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for attn, norm, mlp in zip(self.attn, self.norm, self.mlp):
            x = x + attn(norm(x), mask)
            x = x + mlp(x)
        m = mask.unsqueeze(-1).to(x.dtype)
        return self.head((x * m).sum(1) / m.sum(1).clamp_min(1))


class WithAux(nn.Module):
    """Point 1: the auxiliary loss is part of the forward's output."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model(ids, mask), condcomp.aux_loss(self.model)


def synthetic_batch(step: int, rank: int, batch: int, seq: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Each rank draws its own shard of the global batch (replace with a DistributedSampler over real data)."""
    g = torch.Generator().manual_seed(step * 1000 + rank)
    ids = torch.randint(0, 1000, (batch, seq), generator=g)
    lengths = torch.randint(seq // 2, seq + 1, (batch,), generator=g)
    mask = torch.arange(seq)[None] < lengths[:, None]
    labels = ids[:, 0] % 4  # learnable: the class is written in the first token
    return ids.to(device), mask.to(device), labels.to(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=("ddp", "fsdp2"), default="ddp")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--batch", type=int, default=16, help="per-rank batch size")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--executor", default="auto")
    ap.add_argument("--out", default=None, help="directory for a condcomp checkpoint and metrics.json (rank 0)")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)

    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts them from rank 0)
    model = Encoder()
    cfg = condcomp.CondCompConfig(policy=("budgetformer", {}), router=("topk", {}), executor=args.executor)
    condcomp.apply_(model, cfg)  # before wrapping: the routing parameters are sharded/replicated like the rest
    model.to(device)
    wrapped: nn.Module
    if args.mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        wrapped = DDP(WithAux(model), device_ids=[device.index] if cuda else None, find_unused_parameters=True)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.attn:
            fully_shard(block)
        fully_shard(model)
        wrapped = WithAux(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=3e-4)

    for step in range(args.steps):
        condcomp.set_progress(model, step / max(1, args.steps - 1))  # temperature / entropy schedules
        ids, mask, labels = synthetic_batch(step, rank, args.batch, args.seq, device)
        logits, aux = wrapped(ids, mask)
        loss = nn.functional.cross_entropy(logits, labels) + aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            usage = condcomp.head_usage(model)
            k_frac = sum(u.k_frac for u in usage.values()) / max(1, len(usage))
            print(f"step {step:4d}  loss {loss.item():.4f}  k/H {k_frac:.3f}", flush=True)

    if args.out:
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
        if rank == 0:
            out = Path(args.out)
            cpu = Encoder()
            condcomp.apply_(cpu, cfg)
            cpu.load_state_dict({k: v.detach().cpu() for k, v in state.items()})
            condcomp.save_checkpoint(out / "checkpoint", cpu, cfg, train_state={"step": args.steps, "world": world})
            (out / "metrics.json").write_text(json.dumps({"final_loss": loss.item(), "world_size": world,
                                                          "mode": args.mode}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
