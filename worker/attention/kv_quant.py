"""FP8 (e4m3) KV rows: one float32 scale per row of head_dim values, no calibration.

A row (one token's K or V for one KV head) is stored as `x / scale` cast to e4m3 with
`scale = max(|x|) / 448`, so every row uses the whole e4m3 range whatever the model's
magnitudes. The CUDA kernels (csrc/store_kv.cu, csrc/decode.cu) compute the same bytes and
scales; these torch functions are the CPU path and the tests' reference.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
SCALE_FLOOR = 1e-12  # amax floor: an all-zero row gets a finite scale (and stays zero)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x `[..., D]` -> (e4m3 `[..., D]`, float32 scales `[...]`); round to nearest, saturating."""
    xf = x.float()
    # times the reciprocal: what torch's division by a scalar does on CUDA, and the kernel
    scale = xf.abs().amax(dim=-1).clamp_min(SCALE_FLOOR) * (1.0 / FP8_MAX)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 `[..., D]` times its row scales `[...]`, as `dtype` (e4m3 -> float32 is exact)."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def dequantize_gather(
    cache_layer: torch.Tensor, scale_layer: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Rows `slots` of one layer's cache `[n_slots, Hkv, D]` (scales `[n_slots, Hkv]`),
    dequantized into a new contiguous `[len(slots), Hkv, D]` tensor of `dtype`."""
    # Through uint8: not every torch build has index_select for float8 on every device.
    rows = cache_layer.view(torch.uint8).index_select(0, slots).view(FP8)
    return dequantize(rows, scale_layer.index_select(0, slots), dtype)


def store_rows(
    cache_layer: torch.Tensor, scale_layer: torch.Tensor, slots: torch.Tensor, x: torch.Tensor
) -> None:
    """Quantize x `[T, Hkv, D]` and write it (and its scales) at `slots` of one layer."""
    q, scale = quantize_rows(x)
    # torch has no index_copy_ for float8 on CPU; the bytes are the same through uint8.
    cache_layer.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
    scale_layer.index_copy_(0, slots, scale)
