"""The FP8 KV cache's format (`--kv-cache-dtype fp8`): K and V in float8_e4m3fn, one bf16 scale per (token,
KV head).

    x [n, Hkv, D]  ->  data [n, Hkv, D] float8_e4m3fn (stored as uint8),  scale [n, Hkv] bfloat16
    scale = bf16(max_D |x| / 448)  (448: the largest finite e4m3 value),  data = e4m3(clamp(x / scale, +-448))
    x ~= data * scale

The row's largest element lands on +-448, which e4m3 holds exactly (a power-of-two scale would put it
anywhere in (224, 448], rounded like any other: with an outlier channel in K, the element that decides the
scores; attention error 0.20 against 0.035 with this scale, docs/research/2026-11-25-fp8-kv-cache.md).
The scale keeps a mantissa; bf16, so 2 bytes a row. Rounding: the division in fp32, the cast to e4m3 round
to nearest even. A dequantized value, 4 x 8 significant bits, is exact in fp32, so re-quantizing the
values of an fp32 model gives back the same bytes and scale, and the kernels that apply the scale to
scores (kernels/fp8_paged_attention.py) compute what attention over the dequantized values computes.
The model rounds its K/V to exactly these values before any attention (engine/model/model.py), so that a prompt
attends the same values whether its keys come from this call, the ring or the pages.

Bytes per (token, head): D + 2, against 2 D in bfloat16 (llama3-8b: 65 KiB a token against 128 KiB).
"""
import importlib.util
import os
from typing import NamedTuple

import torch

from burstserve.kernels.arith import ceil_div, next_pow2
from burstserve.kernels.device import below_fp8_capability
from burstserve.kernels.triton_setup import LazyTriton, bf16_by_bits, e4m3_by_arithmetic

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_DTYPE = torch.bfloat16
MIN_SCALE = 2.0 ** -126                              # an all-zero row's scale (its values stay 0)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")        # auto: the model's dtype; fp8 (= fp8_e4m3): this format
SCALE_BYTES = 2                                      # a (token, head) row's bf16 scale

tl = None      # triton.language, bound by _build (the kernel resolves it as a global)
_e4m3 = _bf16 = None   # the interpreter's e4m3 and bf16 roundings (kernels/triton_setup.py), bound by _build


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
        """The first n slots of these blocks [b] (in order) -> [n, Hkv, D] in dtype, as dequantize_kv gives
        them, through tensors of dtype only (a 1M-token context is 1 GiB of bytes a layer: no fp32 copy).
        The same values: an e4m3 value and a bf16 scale are exact in dtype (bf16, fp16 within range, fp32)
        and their product is rounded once, as dequantize_kv rounds its exact fp32 product. On CUDA one
        Triton kernel reads the pages and writes the values (the torch ops take six passes)."""
        kern = _triton.kernels(self.data.device)
        if kern is not None and dtype in (torch.bfloat16, torch.float32) and _pages_ok(self):
            try:
                return _gather_triton(kern["gather"], self, blocks, n, dtype)
            except Exception as e:  # compile or launch failure: torch from now on
                _triton.failed(e)
        if dtype not in (torch.bfloat16, torch.float32):
            return dequantize_kv(self.data[blocks].flatten(0, 1)[:n], self.scale[blocks].flatten(0, 1)[:n], dtype)
        values = self.data[blocks].flatten(0, 1)[:n].view(FP8).to(dtype)                   # [n, Hkv, D]
        return values.mul_(self.scale[blocks].flatten(0, 1)[:n].to(dtype).unsqueeze(-1))

    def gather_range(self, blocks: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Slots start..stop-1 of these blocks [b] (in order) -> [stop - start, Hkv, D] in dtype: the pages
        that hold them gathered, no others."""
        bs = self.data.shape[1]
        first = start // bs
        return self.gather(blocks[first:(stop + bs - 1) // bs], stop - first * bs, dtype)[start - first * bs:]


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


def round_kv_(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """In place where it can: k, v [n, Hkv, D] (rows of any stride, e.g. views of the fused QKV output)
    become round_kv(k), round_kv(v). One kernel on CUDA (the torch ops take about ten per tensor, in every
    layer of every step); the torch ops elsewhere. Returns the rounded k, v."""
    kern = _triton.kernels(k.device)
    if kern is not None and k.shape[0] > 0 and _rows_ok(k, v):
        try:
            _quantize_triton(kern["quantize"], k, v, None, None, None, None, None, write_back=True)
            return k, v
        except Exception as e:      # compile or launch failure: the torch ops from now on
            _triton.failed(e)
    return round_kv(k), round_kv(v)


def store_kv_fp8(k_data: torch.Tensor, k_scale: torch.Tensor, v_data: torch.Tensor, v_scale: torch.Tensor,
                 slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k, v [n, Hkv, D] quantized (quantize_kv) into slots [n] of one layer's pages: data [pages, block,
    Hkv, D] uint8 and scale [pages, block, Hkv] bf16, contiguous. One kernel on CUDA."""
    kern = _triton.kernels(k.device)
    if kern is not None and k.shape[0] > 0 and _rows_ok(k, v):
        try:
            _quantize_triton(kern["quantize"], k, v, k_data, k_scale, v_data, v_scale, slots, write_back=False)
            return
        except Exception as e:
            _triton.failed(e)
    for data, scales, x in ((k_data, k_scale, k), (v_data, v_scale, v)):
        q8, scale = quantize_kv(x)                                          # [n, Hkv, D] uint8, [n, Hkv] bf16
        data.view(-1, *data.shape[2:]).index_copy_(0, slots, q8)
        scales.view(-1, scales.shape[-1]).index_copy_(0, slots, scale)


# ---------------------------------------------------------------- Triton (the two calls above)

def _rows_ok(k, v) -> bool:
    """The kernel's layout: [n, Hkv, D] with heads and elements contiguous within a row, D a power of 2; bf16
    or fp32 (fp16 rows go through the torch ops: on a GPU the kernel's fp16 values differed from theirs)."""
    d = k.shape[-1]
    return (all(x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == d for x in (k, v)) and d & (d - 1) == 0
            and k.dtype in (torch.bfloat16, torch.float32))


def _pages_ok(pages: "Fp8Pages") -> bool:
    """Pages the gather kernel reads: contiguous data and scales."""
    return pages.data.is_contiguous() and pages.scale.is_contiguous()


GATHER_TOKENS = 16     # tokens a program of the gather kernel dequantizes


def _gather_triton(kernel, pages: "Fp8Pages", blocks: torch.Tensor, n: int, dtype: torch.dtype) -> torch.Tensor:
    """Fp8Pages.gather in one kernel -> [n, Hkv, D] in dtype (bf16 or fp32)."""
    _, bs, hkv, d = pages.data.shape
    out = torch.empty(n, hkv, d, dtype=dtype, device=pages.data.device)
    if n == 0:
        return out
    hd = hkv * d
    kernel[(ceil_div(n, GATHER_TOKENS),)](
        pages.data, pages.scale.view(torch.int16), blocks, out.view(torch.int16) if dtype == torch.bfloat16 else out,
        n, BS=bs, D=d, HD=hd, HDPAD=next_pow2(hd), T=GATHER_TOKENS, OUT_BF16=dtype == torch.bfloat16)
    return out


def _quantize_triton(kernel, k, v, k_data, k_scale, v_data, v_scale, slots, write_back):
    n, hkv, d = k.shape
    if not write_back:
        assert all(t.is_contiguous() for t in (k_data, k_scale, v_data, v_scale))
    dummy = k                                                     # pointers the variant does not touch
    kernel[(n, 2)](k, v, k.stride(0), v.stride(0),
                   k_data if not write_back else dummy, k_scale if not write_back else dummy,
                   v_data if not write_back else dummy, v_scale if not write_back else dummy,
                   slots if not write_back else dummy,
                   HKV=hkv, HPAD=max(2, 1 << (hkv - 1).bit_length()), D=d, WRITE_BACK=write_back,
                   ARITH_CAST=os.environ.get("TRITON_INTERPRET") == "1")


def _build() -> dict:
    """jit the quantize kernel. A fresh one each call: tests build an interpreted one (TRITON_INTERPRET=1)."""
    global tl, _e4m3, _bf16
    import triton
    import triton.language as tl
    _e4m3, _bf16 = e4m3_by_arithmetic(), bf16_by_bits()

    def quantize_kernel(k_ptr, v_ptr, k_row, v_row, kd_ptr, ks_ptr, vd_ptr, vs_ptr, slots_ptr,
                        HKV: tl.constexpr, HPAD: tl.constexpr, D: tl.constexpr, WRITE_BACK: tl.constexpr,
                        ARITH_CAST: tl.constexpr):
        """Program (token t, which: 0 = k, 1 = v): the token's Hkv rows of D values quantized as quantize_kv
        does (a bf16 scale amax / 448 per row, the division rounded to nearest, e4m3 round to nearest even);
        WRITE_BACK: the dequantized values over the input (round_kv); else bytes and scales into the slot."""
        t = tl.program_id(0).to(tl.int64)
        which = tl.program_id(1)
        heads = tl.arange(0, HPAD)
        cols = tl.arange(0, D)
        ok = heads[:, None] < HKV
        row_ptr = tl.where(which == 0, k_ptr + t * k_row, v_ptr + t * v_row)
        at = heads[:, None] * D + cols[None, :]                                      # [HPAD, D]
        x = tl.load(row_ptr + at, mask=ok, other=0.0)
        xf = x.to(tl.float32)
        # divisions rounded to nearest, as torch's (Triton's `/` on fp32 may be off by an ulp)
        scale = tl.maximum(tl.div_rn(tl.max(tl.abs(xf), axis=1), 448.0), 1.1754943508222875e-38)   # MIN_SCALE
        if ARITH_CAST:      # the interpreter's fp32 -> bf16 cast does not round to nearest even: by bits
            scale = _bf16(scale)
        else:
            scale = scale.to(tl.bfloat16).to(tl.float32)                              # [HPAD]
        y = tl.minimum(tl.maximum(tl.div_rn(xf, scale[:, None]), -448.0), 448.0)
        if ARITH_CAST:      # its fp32 -> e4m3 cast drops the carry into the exponent (31.9 -> 16)
            y = _e4m3(y)
        q8 = y.to(tl.float8e4nv)
        if WRITE_BACK:
            tl.store(row_ptr + at, (q8.to(tl.float32) * scale[:, None]).to(x.dtype), mask=ok)
        else:
            slot = tl.load(slots_ptr + t).to(tl.int64)
            data_ptr = tl.where(which == 0, kd_ptr, vd_ptr)
            scale_ptr = tl.where(which == 0, ks_ptr, vs_ptr)
            tl.store(data_ptr + slot * (HKV * D) + at, q8.to(tl.uint8, bitcast=True), mask=ok)
            tl.store(scale_ptr + slot * HKV + heads, scale.to(tl.bfloat16), mask=heads < HKV)

    def gather_kernel(data_ptr, scale_ptr, blocks_ptr, out_ptr, n, BS: tl.constexpr, D: tl.constexpr,
                      HD: tl.constexpr, HDPAD: tl.constexpr, T: tl.constexpr, OUT_BF16: tl.constexpr):
        """Program p: tokens p*T .. p*T + T - 1 of the blocks' slots (block t // BS, slot t % BS), each token's
        Hkv rows of D e4m3 bytes times its rows' bf16 scales -> out [n, HD] (bf16 as its bits, or fp32). The
        scales are read as bits and widened by a shift, and bf16 is rounded by bits (to nearest, ties to
        even): exact, and the same under the Triton interpreter, which loads bf16 as raw bits."""
        t = tl.program_id(0).to(tl.int64) * T + tl.arange(0, T)                       # [T]
        cols = tl.arange(0, HDPAD)                                                    # [HDPAD]
        live = t < n
        ok = live[:, None] & (cols[None, :] < HD)
        page = tl.load(blocks_ptr + t // BS, mask=live, other=0).to(tl.int64)
        row = page * BS + t % BS                                                      # [T]
        q8 = tl.load(data_ptr + row[:, None] * HD + cols[None, :], mask=ok, other=0)
        bits = tl.load(scale_ptr + row[:, None] * (HD // D) + cols[None, :] // D, mask=ok, other=0)
        scale = ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        x = q8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * scale                # exact: 4 x 8 bits
        at = out_ptr + t[:, None] * HD + cols[None, :]
        if OUT_BF16:
            b = x.to(tl.int32, bitcast=True)
            b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
            tl.store(at, b.to(tl.int16), mask=ok)
        else:
            tl.store(at, x, mask=ok)

    # gather's size specialized: 16-byte loads and stores (kernels/fused.py's note). quantize's row strides
    # stay unspecialized: specialized, its fp32 rows' write-back (round_kv_) did not give the torch ops' bits
    # on a GPU (tests/gpu/test_kernels_gpu.py, fp8_kv_round); not yet found why
    return {"quantize": triton.jit(quantize_kernel, do_not_specialize=["k_row", "v_row"]),
            "gather": triton.jit(gather_kernel)}


_triton = LazyTriton(_build, "kv-quant")


def kv_cache_refusal(kv_cache_dtype: str, devices: list[str]) -> str | None:
    """Why this KV cache dtype cannot run on these devices, or None. On GPUs FP8 pages need Triton (the
    write and decode kernels; it comes with torch's CUDA wheels) and FP8 conversions (capability 8.9+)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        return f"kv_cache_dtype {kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
    gpus = [d for d in devices if d.startswith("cuda")]
    if not is_fp8(kv_cache_dtype) or not gpus:
        return None
    if importlib.util.find_spec("triton") is None:
        return ("--kv-cache-dtype fp8 on GPUs needs Triton (its page write and decode kernels), which is not "
                "installed: `pip install triton` (torch's CUDA wheels bring it), or use --kv-cache-dtype auto")
    return below_fp8_capability(gpus, "--kv-cache-dtype fp8 on GPUs needs FP8 conversions")
