"""grouped_sdpa answers the same attention whatever memory layout SDPA hands back.

On CUDA, PyTorch's fused attention kernels return outputs whose memory is laid out (B, T, H, Dh) rather than
(B, H, T, Dh); the decode branch's ``.view`` then failed on an H200 for every GQA model with a compact cache. These
tests make SDPA return such a layout on CPU and compare with a float64 attention written out here.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import condcomp.dense as dense


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """float64 attention of q (B, H, T, Dh) over grouped k/v (B, Hkv, S, Dh), no mask."""
    group = q.shape[1] // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    weights = torch.softmax(q.double() @ k64.transpose(-1, -2) * scale, dim=-1)
    return weights @ v64


SDPA = F.scaled_dot_product_attention


def strided_like_cuda(*args: object, **kwargs: object) -> torch.Tensor:
    out = SDPA(*args, **kwargs)  # type: ignore[arg-type]
    return out.transpose(1, 2).contiguous().transpose(1, 2)  # same values, (B, T, H, Dh) memory as on CUDA


@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("query_layout", ["contiguous", "transposed"])
def test_grouped_sdpa_with_non_contiguous_outputs_and_queries(monkeypatch: pytest.MonkeyPatch, T: int,
                                                                query_layout: str) -> None:
    torch.manual_seed(0)
    B, H, Hkv, S, Dh = 2, 6, 2, 7, 8
    q = torch.randn(B, T, H, Dh).transpose(1, 2) if query_layout == "transposed" else torch.randn(B, H, T, Dh)
    k, v = torch.randn(B, Hkv, S, Dh), torch.randn(B, Hkv, S, Dh)
    monkeypatch.setattr(dense.F, "scaled_dot_product_attention", strided_like_cuda)
    out = dense.grouped_sdpa(q, k, v, None, False, Dh**-0.5)
    assert out.shape == (B, H, T, Dh)
    torch.testing.assert_close(out.double(), reference(q, k, v, Dh**-0.5), atol=1e-5, rtol=1e-5)
