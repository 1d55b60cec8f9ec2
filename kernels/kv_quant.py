"""The FP8 KV cache's format (`--kv-cache-dtype fp8`): K and V in float8_e4m3fn, one power-of-two scale
per (token, KV head).

    x [n, Hkv, D]  ->  data [n, Hkv, D] float8_e4m3fn (stored as uint8),  exp [n, Hkv] uint8
    x ~= data * 2^(exp - EXP_BIAS)

The scale of a (token, head) row is the smallest power of two 2^e with max_D |x| * 2^-e <= 448 (the largest
finite e4m3 value): the row's largest element lands in (224, 448], and an outlier channel costs only
that row's precision. A power of two (stored as its biased exponent, one byte: the OCP microscaling
formats' E8M0) is exact to apply and to undo, so the rounding is the cast to e4m3 alone, round to nearest
even, the same in torch on any device and in a kernel: a CPU reference and a GPU kernel agree bit for
bit. A dequantized value has 4 significant bits, so it is exact in bfloat16 (and fp32): attention over
dequantized pages equals attention over K/V rounded once (`round_kv`), which is what the model does to
its K/V before any attention (engine/model.py), so that a prompt attends the same values whether its
keys come from this call, the ring or the pages.

The exponent from the row's max, m * 2^k (torch.frexp: m in [0.5, 1)): 448 = 0.875 * 2^9, so
e = k - 9 where m <= 0.875, else k - 8; clamped to [-EXP_BIAS, EXP_BIAS] (an all-zero row: e = -9).
Bytes per (token, head): D + 1, against 2 D in bfloat16 (llama3-8b: 64.5 KiB a token against 128 KiB).
"""
import os
from typing import NamedTuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
EXP_BIAS = 127
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")        # auto: the model's dtype; fp8 (= fp8_e4m3): this format
SCALE_BYTES = 1                                      # a (token, head) row's exponent


def is_fp8(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype in ("fp8", "fp8_e4m3")


class Fp8Pages(NamedTuple):
    """One layer's K (or V) pages in FP8: what kernels.paged_attention reads in place of a bf16 cache."""
    data: torch.Tensor     # [num_blocks, block_size, Hkv, D] uint8 (float8_e4m3fn bits)
    exp: torch.Tensor      # [num_blocks, block_size, Hkv] uint8, biased exponents

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def gather(self, blocks: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
        """The first n slots of these blocks [b] (in order) -> [n, Hkv, D] in dtype."""
        return dequantize_kv(self.data[blocks].flatten(0, 1)[:n], self.exp[blocks].flatten(0, 1)[:n], dtype)


def exponents(amax: torch.Tensor) -> torch.Tensor:
    """amax [...] fp32 (>= 0) -> e [...] int32: the smallest e with amax * 2^-e <= 448."""
    m, k = torch.frexp(amax)
    e = k - 9 + (m > 0.875).to(torch.int32)
    return e.clamp(-EXP_BIAS, EXP_BIAS)


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (data [..., D] uint8 (e4m3 bits), exp [...] uint8)."""
    xf = x.float()
    e = exponents(xf.abs().amax(dim=-1))                                   # [...]
    data = torch.ldexp(xf, -e.unsqueeze(-1)).to(FP8)                       # exact scaling, then the one rounding
    return data.view(torch.uint8), (e + EXP_BIAS).to(torch.uint8)


def dequantize_kv(data: torch.Tensor, exp: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(data [..., D] uint8, exp [...] uint8) -> [..., D] in dtype (exact in bf16 and fp32)."""
    e = exp.to(torch.int32) - EXP_BIAS
    return torch.ldexp(data.view(FP8).float(), e.unsqueeze(-1)).to(dtype)


def pack_kv(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> one uint8 message [..., D + 1]: the FP8 bytes, then the row's exponent (what a K/V ring
    sends: D + 1 bytes a row against 2 D in bf16)."""
    data, exp = quantize_kv(x)
    return torch.cat([data, exp.unsqueeze(-1)], dim=-1)


def unpack_kv(packed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """pack_kv's message [..., D + 1] -> the rounded values [..., D] in dtype."""
    return dequantize_kv(packed[..., :-1], packed[..., -1], dtype)


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
    for d in gpus:
        major, minor = torch.cuda.get_device_capability(torch.device(d))
        if (major, minor) < (8, 9):
            return (f"--kv-cache-dtype fp8 on GPUs needs FP8 conversions (compute capability 8.9 or newer); {d} is "
                    f"capability {major}.{minor}")
    return None
