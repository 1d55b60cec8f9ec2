"""The FP8 KV cache's format (`--kv-cache-dtype fp8`): K and V in float8_e4m3fn, one bf16 scale per (token,
KV head).

    x [n, Hkv, D]  ->  data [n, Hkv, D] float8_e4m3fn (stored as uint8),  scale [n, Hkv] bfloat16
    scale = bf16(max_D |x| / 448)  (448: the largest finite e4m3 value),  data = e4m3(clamp(x / scale, +-448))
    x ~= data * scale

The row's largest element lands on +-448, which e4m3 holds exactly (a power-of-two scale would put it
anywhere in (224, 448], rounded like any other: with an outlier channel in K, the element that decides the
scores; attention error 0.20 against 0.035 so: docs/results/log.md, "The FP8 KV format's rounding error").
The scale keeps a mantissa; bf16, so 2 bytes a row. Rounding: the division in fp32, the cast to e4m3 round
to nearest even. A dequantized value, 4 x 8 significant bits, is exact in fp32, so re-quantizing the
values of an fp32 model gives back the same bytes and scale, and the kernels that apply the scale to
scores (kernels/fp8_paged_attention.py) compute what attention over the dequantized values computes.
The model rounds its K/V to exactly these values before any attention (engine/model.py), so that a prompt
attends the same values whether its keys come from this call, the ring or the pages.

Bytes per (token, head): D + 2, against 2 D in bfloat16 (llama3-8b: 65 KiB a token against 128 KiB).
"""
import os
from typing import NamedTuple

import torch

from kernels.fp8 import below_fp8_capability

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_DTYPE = torch.bfloat16
MIN_SCALE = 2.0 ** -126                              # an all-zero row's scale (its values stay 0)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")        # auto: the model's dtype; fp8 (= fp8_e4m3): this format
SCALE_BYTES = 2                                      # a (token, head) row's bf16 scale


def is_fp8(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in ("fp8", "fp8_e4m3")


class Fp8Pages(NamedTuple):
    """One layer's K (or V) pages in FP8: what kernels.paged_attention reads in place of a bf16 cache."""
    data: torch.Tensor     # [num_blocks, block_size, Hkv, D] uint8 (float8_e4m3fn bits)
    scale: torch.Tensor    # [num_blocks, block_size, Hkv] bfloat16

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def gather(self, blocks: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The first n slots of these blocks [b] (in order) -> [n, Hkv, D] in dtype."""
        return dequantize_kv(self.data[blocks].flatten(0, 1)[:n], self.scale[blocks].flatten(0, 1)[:n], dtype)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (data [..., D] uint8 (e4m3 bits), scale [...] bf16)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_SCALE).to(SCALE_DTYPE)          # [...]
    data = (xf / scale.float().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8)             # the one rounding
    return data.view(torch.uint8), scale


def dequantize_kv(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(data [..., D] uint8, scale [...] bf16) -> [..., D] in dtype (exact in fp32)."""
    return (data.view(FP8).float() * scale.float().unsqueeze(-1)).to(dtype)


def pack_kv(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> one uint8 message [..., D + 2]: the FP8 bytes, then the row's bf16 scale (what a K/V ring
    sends: D + 2 bytes a row against 2 D in bf16)."""
    data, scale = quantize_kv(x)
    return torch.cat([data, scale.unsqueeze(-1).view(torch.uint8)], dim=-1)


def unpack_kv(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pack_kv's message [..., D + 2] -> the rounded values [..., D] in dtype."""
    scale = packed[..., -SCALE_BYTES:].contiguous().view(SCALE_DTYPE).squeeze(-1)
    return dequantize_kv(packed[..., :-SCALE_BYTES], scale, dtype)


def round_kv(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> the values an FP8 cache gives back for it, in x's dtype."""
    return dequantize_kv(*quantize_kv(x), x.dtype)


GPU_ENV = "BURSTSERVE_EXPERIMENTAL_FP8_KV_GPU"    # "1": FP8 pages on GPUs, before their GPU runs are done


def kv_cache_refusal(kv_cache_dtype: str, devices: list[str]) -> str | None:
    """Why this KV cache dtype cannot run on these devices, or None."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        return f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
    gpus = [d for d in devices if d.startswith("cuda")]
    if not is_fp8(kv_cache_dtype) or not gpus:
        return None
    if os.environ.get(GPU_ENV) != "1":
        return ("--kv-cache-dtype fp8 runs on CPU workers only in this version: on GPUs its decode kernel is built "
                "but its engine runs (chunks and prefix hits over FP8 pages, accuracy, speed) are not done yet "
                f"(issue 35; {GPU_ENV}=1 runs it anyway); use --kv-cache-dtype auto on GPUs")
    return below_fp8_capability(gpus, "--kv-cache-dtype fp8 on GPUs needs FP8 conversions")
