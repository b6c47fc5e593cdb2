"""Tiny routed models shared by the hardening, compile and distributed tests (not a test module itself).

The policy and router here are deliberately small, deterministic and unregistered (so registry-driven tests
elsewhere never see them): a learned per-example budget and a learned head scorer, both computing in float32
as the library's components must.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from condcomp.adapters import find_adapter
from condcomp.attention import HeadAttention
from condcomp.plans import budget_k, plan_from_active, plan_top_k
from condcomp.routed import RoutedAttention
from condcomp.types import AttentionWeights, Budget, HeadPlan


def _pool(x: Tensor, mask: Tensor | None) -> Tensor:
    x = x.float()
    if mask is None:
        return x.mean(1)
    m = mask.float().unsqueeze(-1)  # (B, T, 1)
    return (x * m).sum(1) / m.sum(1).clamp_min(1.0)


class LearnedPolicy(nn.Module):
    """s = sigmoid(w . mean(x)); k = clamp(floor(s H), k_min, H); a hinge keeps s in [0.1, 0.9]."""

    def __init__(self, d_model: int, num_heads: int, k_min: int = 1) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, 1)
        self.num_heads, self.k_min = num_heads, k_min

    def forward(self, x: Tensor, mask: Tensor | None) -> Budget:
        s = torch.sigmoid(self.proj(_pool(x, mask))).squeeze(-1)  # (B,)
        hinge = (torch.relu(0.1 - s) ** 2 + torch.relu(s - 0.9) ** 2).mean()
        return Budget(s=s, k=budget_k(s, self.num_heads, self.k_min), aux_losses={"budget": hinge})


class LearnedRouter(nn.Module):
    """Scores heads from the pooled input; top-k with renormalised gates (the gradient reaches the scorer)."""

    granularity = "sequence"

    def __init__(self, d_model: int, num_heads: int) -> None:
        super().__init__()
        self.score = nn.Linear(d_model, num_heads)

    def forward(self, x: Tensor, mask: Tensor | None, budget: Budget, attn: AttentionWeights) -> HeadPlan:
        return plan_top_k(self.score(_pool(x, mask)), budget.k, gates="renormalized")


class PerHeadRouter(nn.Module):
    """One parameter per head, touched only when some row selects that head: heads unused by a whole batch
    leave their parameter out of the autograd graph (what DDP's find_unused_parameters is about).
    ``touch_all=True`` keeps every parameter in the graph with a zero gradient instead (what FSDP2 needs)."""

    granularity = "sequence"

    def __init__(self, d_model: int, num_heads: int, touch_all: bool = False) -> None:
        super().__init__()
        self.touch_all = touch_all
        self.score = nn.Linear(d_model, num_heads)
        self.head_scale = nn.ParameterList([nn.Parameter(torch.ones(1)) for _ in range(num_heads)])  # 1-D: FSDP2

    def forward(self, x: Tensor, mask: Tensor | None, budget: Budget, attn: AttentionWeights) -> HeadPlan:
        plan = plan_top_k(self.score(_pool(x, mask)), budget.k, gates="binary", straight_through=True)
        used = plan.active.any(0).tolist()  # data-dependent on purpose
        ones = torch.ones(1, device=x.device)
        skipped = [p * 0 + 1 if self.touch_all else ones for p in self.head_scale]
        scale = torch.cat([p if u else q for p, q, u in zip(self.head_scale, skipped, used)])  # (H,)
        return plan_from_active(plan.active, plan.gates * scale)


class TinyNet(nn.Module):
    """Residual stack of routed HeadAttention layers and a linear classifier on the mean-pooled output."""

    def __init__(self, d_model: int = 32, num_heads: int = 4, layers: int = 2, classes: int = 3,
                 executor: str = "reference", share_policy: bool = True, router: str = "learned",
                 num_kv_heads: int | None = None, causal: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        shared = LearnedPolicy(d_model, num_heads) if share_policy else None
        for _ in range(layers):
            base = HeadAttention(d_model, num_heads, num_kv_heads=num_kv_heads, causal=causal)
            adapter_cls = find_adapter(base)
            assert adapter_cls is not None
            policy = shared if shared is not None else LearnedPolicy(d_model, num_heads)
            r = (LearnedRouter(d_model, num_heads) if router == "learned"
                 else PerHeadRouter(d_model, num_heads, touch_all=router == "perhead_touch"))
            self.layers.append(RoutedAttention(base, adapter_cls(base), policy, r, executor))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        for layer in self.layers:
            x = x + layer(self.norm(x), mask)
        return self.head(_pool(x, mask).to(x.dtype))


def set_executor(model: nn.Module, name: str) -> None:
    for m in model.modules():
        if isinstance(m, RoutedAttention):
            m.executor = name


class CharTokenizer:
    """A stand-in for SmolLM2's tokenizer in commands under test: one token per character, no download."""

    pad_token_id, eos_token_id = 1, 2

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> dict[str, list[list[int]]]:
        return {"input_ids": [[3 + (ord(c) % 90) for c in t] for t in texts]}

    def get_vocab(self) -> dict[str, int]:
        return {"<|endoftext|>": 0}

    def decode(self, tokens: list[int] | Tensor) -> str:
        return "".join(chr(int(t)) for t in tokens)


def tiny_char_llama() -> tuple[nn.Module, CharTokenizer]:
    """A seeded 2-layer random Llama (GQA 4/2) and :class:`CharTokenizer`: SmolLM2's loader in tests."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=97, max_position_embeddings=64,
                                   attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg).eval(), CharTokenizer()
