"""The DiT's routed attention: every executor against the reference executor, and MoH inside the DiT against a
hand-written float64 re-implementation of the released MoH attention (not condcomp's code)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import condcomp
from condcomp.api import routed_modules
from condcomp.experiments.dit.model import DiT, DiTConfig
from condcomp.experiments.dit.variants import moh_heads, variant_config

CFG = DiTConfig(image_size=8, patch=2, d_model=40, num_layers=2, num_heads=20, freq_dim=16)


def dit_with(variant: str, executor: str, seed: int = 0, fraction: float | None = None) -> DiT:
    torch.manual_seed(seed)
    model = DiT(CFG)
    with torch.no_grad():  # adaLN-Zero starts every block as the identity: perturb it so attention matters
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    config = variant_config(variant, CFG.num_heads, CFG.num_layers, CFG.d_model, executor, fraction)
    assert config is not None
    condcomp.apply_(model, config)
    return model.eval()


def inputs(seed: int = 1) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((5, 1, 8, 8), generator=g), torch.rand(5, generator=g), torch.tensor([0, 3, 9, 10, 4])


@pytest.mark.parametrize("variant,fraction", [("moh_90", None), ("moh_75", None), ("moh_50", None),
                                              ("budgetformer_cond", None), ("fixed", 0.6)])
@pytest.mark.parametrize("executor", ["masked", "gathered", "auto"])
def test_every_executor_matches_the_reference_executor_in_the_dit(variant: str, fraction: float | None,
                                                                  executor: str) -> None:
    x, t, y = inputs()
    with torch.no_grad():
        want = dit_with(variant, "reference", fraction=fraction)(x, t, y)
        got = dit_with(variant, executor, fraction=fraction)(x, t, y)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def released_moh_attention(x: Tensor, attn: nn.Module, router: nn.Module, shared: int, top_k: int) -> Tensor:
    """MoH attention as the released code computes it, in float64, with explicit per-token loops over heads:
    every head computed densely, output ``sum_i g_i * head_i W_O^i + b_O`` with the released gates
    (stage weights ``2 softmax(W_h x)``, shared ``h_s softmax(W_s x)``, routed ``softmax(W_r x)`` kept on the
    Top-K, renormalised over it and times K)."""
    x = x.double()
    B, T, D = x.shape
    H = 20
    Dh = D // H

    def lin(m: nn.Linear, v: Tensor) -> Tensor:
        return v @ m.weight.double().T + (m.bias.double() if m.bias is not None else 0.0)

    q, k, v = (lin(getattr(attn, n), x).reshape(B, T, H, Dh) for n in ("q_proj", "k_proj", "v_proj"))
    out = torch.zeros(B, T, D, dtype=torch.float64)
    Wo, bo = attn.o_proj.weight.double(), attn.o_proj.bias.double()
    for b in range(B):
        for i in range(T):
            tok = x[b, i]
            a = 2.0 * torch.softmax(router.w_h.weight.double() @ tok, 0)
            gates = [0.0] * H
            sh = torch.softmax(router.w_s.weight.double() @ tok, 0)
            for h in range(shared):
                gates[h] = float(a[0] * shared * sh[h])
            logits = router.w_r.weight.double() @ tok
            probs = torch.softmax(logits, 0)
            chosen = sorted(range(H - shared), key=lambda j: (-float(logits[j]), j))[:top_k]
            kept = sum(float(probs[j]) for j in chosen)
            for j in chosen:
                gates[shared + j] = float(a[1] * top_k * probs[j] / kept)
            y = bo.clone()
            for h in range(H):
                scores = torch.stack([q[b, i, h] @ k[b, s, h] for s in range(T)]) / Dh**0.5
                head = torch.softmax(scores, 0) @ v[b, :, h]  # (Dh,)
                y = y + gates[h] * (Wo[:, h * Dh:(h + 1) * Dh] @ head)
            out[b, i] = y
    return out


@pytest.mark.parametrize("variant", ["moh_90", "moh_50"])
def test_moh_in_the_dit_is_the_released_moh_attention(variant: str) -> None:
    model = dit_with(variant, "masked")
    seen: list[tuple[Tensor, Tensor]] = []
    layer = routed_modules(model)["blocks.1.attn"]
    hook = layer.register_forward_hook(lambda m, args, kwargs, out: seen.append((args[0].detach(), out.detach())),
                                       with_kwargs=True)
    x, t, y = inputs()
    with torch.no_grad():
        model(x[:2], t[:2], y[:2])
    hook.remove()
    shared, top_k = moh_heads(variant, 20)
    assert (shared, top_k) == ({"moh_90": (5, 13), "moh_50": (5, 5)}[variant])
    with torch.no_grad():
        want = released_moh_attention(seen[0][0], layer, layer.condcomp_router, shared, top_k)
    torch.testing.assert_close(seen[0][1].double(), want, atol=1e-5, rtol=1e-4)
    usage = condcomp.head_usage(model)["blocks.1.attn"]
    assert usage.k_frac == pytest.approx({"moh_90": 0.9, "moh_50": 0.5}[variant])


def test_moh_head_counts_must_be_whole() -> None:
    with pytest.raises(ValueError, match="not a whole head count"):
        variant_config("moh_90", 8, 2, 16)
    with pytest.raises(KeyError, match="unknown DiT variant"):
        variant_config("moh_80", 20, 2, 40)
    with pytest.raises(ValueError, match="fraction"):
        variant_config("fixed", 20, 2, 40)
