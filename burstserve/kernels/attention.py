"""Local attention backends: (q, k, v, causal, scale) -> (out, lse), never a score matrix on GPU.

Layout: q [Sq, H, D], k and v [Sk, Hkv, D] with H % Hkv == 0 (GQA without repeating K/V where the
backend allows); out [Sq, H, D] in q's dtype, lse [Sq, H] fp32 (natural log). `causal` means query i
sees keys 0..i (top-left aligned); callers use it only on square blocks of the same tokens.
An empty key block gives out = 0 and lse = -inf.
"""
import logging
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

from burstserve.kernels.fa3_fp8 import fa3_fp8_attention, fa3_fp8_refusal

log = logging.getLogger(__name__)

KernelFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, float], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    fn: KernelFn
    fp8: bool = False      # FP8 arithmetic (fa3-fp8): a chunk's paged calls gather the pages and run it too

    def __call__(self, q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        sq, h, d = q.shape
        if sq == 0 or k.shape[0] == 0:
            out = torch.zeros(sq, h, v.shape[-1], dtype=q.dtype, device=q.device)
            return out, torch.full((sq, h), float("-inf"), dtype=torch.float32, device=q.device)
        return self.fn(q, k, v, causal, scale)


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(0, 1).unsqueeze(0)            # [S, H, D] -> [1, H, S, D] (a view)


def _cudnn(q, k, v, causal, scale):
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, causal, False, scale=scale)
    out, lse = res[0], res[1]
    return out[0].transpose(0, 1), lse.reshape(lse.shape[1], lse.shape[2]).transpose(0, 1).float()


def _flash_aten(q, k, v, causal, scale):
    """PyTorch's own flash attention: FA2 on CUDA; on CPU its blocked kernel (_flash_cpu)."""
    if q.device.type == "cpu":
        return _flash_cpu(q, k, v, causal, scale)
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, False, scale=scale)
    return res[0][0].transpose(0, 1), res[1][0].transpose(0, 1).float()


def _flash_cpu(q, k, v, causal, scale):
    """PyTorch's CPU flash attention (blocked, multi-threaded, no score matrix): an order of magnitude
    faster than the reference on a long causal block. It wants as many K/V heads as query heads: GQA repeats
    them (query head j reads K/V head j // group, as the reference)."""
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _bhsd(q), _bhsd(k), _bhsd(v), 0.0, causal, scale=scale)
    return out[0].transpose(0, 1), lse[0].transpose(0, 1).float()


def _flash_attn_pkg(q, k, v, causal, scale):
    from flash_attn import flash_attn_func
    out, lse, _ = flash_attn_func(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale=scale,
                                  causal=causal, return_attn_probs=True)
    return out[0], lse[0].transpose(0, 1).float()


def _flash_attn_4(q, k, v, causal, scale):
    """FlashAttention-4 (`flash-attn-4`: flash_attn.cute, CuTe-DSL; SM90+): GQA without repeated K/V,
    LSE [B, H, S]. Each new shape configuration compiles on its first call."""
    out, lse = fa4_forward(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), softmax_scale=scale, causal=causal)
    return out[0], lse[0].transpose(0, 1)


_FA4_DIRECT = [True]     # False once flash-attn-4's private forward refused our arguments: the public functions


def fa4_forward(q, k, v, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """flash-attn-4's forward with LSE -> (out, lse), called as `flash_attn.cute.interface._flash_attn_fwd`
    without the autograd Function and the wrappers of the public functions around it: a third less host
    time a call, which counts where a small chunk is bound by the host (docs/benchmarks.md, Kernels).
    kwargs are the public functions' own (softmax_scale, causal; cu_seqlens_q, seqused_k, page_table,
    max_seqlen_q); a flash-attn-4 whose private function is gone or takes other arguments gets the
    public ones."""
    if _FA4_DIRECT[0]:
        try:
            from flash_attn.cute.interface import _flash_attn_fwd
            result = _flash_attn_fwd(q, k, v, return_lse=True, **kwargs)
            return result[0], result[1]
        except (ImportError, TypeError) as e:
            _FA4_DIRECT[0] = False
            log.warning("flash-attn-4's _flash_attn_fwd cannot be called directly (%s); using its public functions", e)
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    public = flash_attn_varlen_func if "cu_seqlens_q" in kwargs else flash_attn_func
    return public(q, k, v, return_lse=True, **kwargs)


def reference_attention(q, k, v, causal, scale, query_chunk: int = 1024):
    """Materialized scores in fp32, a query chunk at a time: the CPU path and the no-LAO ablation."""
    sq, h, d = q.shape
    sk, hkv, _ = k.shape
    g = h // hkv
    kf, vf = k.float(), v.float()
    outs, lses = [], []
    for start in range(0, sq, query_chunk):
        qc = q[start:start + query_chunk].float().view(-1, hkv, g, d)            # [c, Hkv, g, D]
        scores = torch.einsum("qhgd,khd->hgqk", qc, kf) * scale                  # [Hkv, g, c, Sk]
        if causal:
            rows = torch.arange(start, start + qc.shape[0], device=q.device)
            mask = torch.arange(sk, device=q.device)[None, :] > rows[:, None]     # [c, Sk]
            scores.masked_fill_(mask, float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)                                    # [Hkv, g, c]
        probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
        out = torch.einsum("hgqk,khd->qhgd", probs, vf)                          # [c, Hkv, g, D]
        outs.append(out.reshape(-1, h, v.shape[-1]))
        lses.append(lse.reshape(h, -1).transpose(0, 1))
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


def windowed_attention(q, k, v, scale: float, window: int, query_chunk: int = 1024):
    """Sliding-window causal attention, aligned to the end: q [m, H, D] are the last m of the n positions whose
    keys k, v [n, Hkv, D] hold; query i (position n - m + i) sees the keys j with n - m + i - window < j <= n - m + i
    (transformers' sliding window: `window` keys, its own included) -> (out [m, H, D] in q's dtype, lse [m, H] fp32).
    Materialized in fp32 a query chunk at a time, each against only the keys its window reaches."""
    m, n = q.shape[0], k.shape[0]
    outs, lses = [], []
    for start in range(0, m, query_chunk):
        stop = min(start + query_chunk, m)
        first, last = n - m + start, n - m + stop - 1           # the chunk's positions
        lo = max(0, first - window + 1)
        out, lse = _masked(q[start:stop], k[lo:last + 1], v[lo:last + 1], scale,
                           torch.arange(first, last + 1, device=q.device), lo, window)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs).to(q.dtype), torch.cat(lses)


def _masked(q, k, v, scale: float, positions: torch.Tensor, first_key: int, window: int):
    """q [c, H, D] at `positions` [c] against the keys of positions first_key .. first_key + len(k) - 1, each
    query seeing its window of them -> (out [c, H, D] fp32, lse [c, H])."""
    c, h, d = q.shape
    hkv = k.shape[1]
    qc = q.float().view(c, hkv, h // hkv, d)
    scores = torch.einsum("qhgd,khd->hgqk", qc, k.float()) * scale                 # [Hkv, g, c, Sk]
    keys = torch.arange(first_key, first_key + k.shape[0], device=q.device)
    gap = positions[:, None] - keys[None, :]                                       # [c, Sk]
    scores.masked_fill_((gap < 0) | (gap >= window), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)                                          # [Hkv, g, c]
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, 0.0).unsqueeze(-1))
    out = torch.einsum("hgqk,khd->qhgd", probs, v.float())
    return out.reshape(c, h, v.shape[-1]), lse.reshape(h, c).transpose(0, 1)


_GPU_BACKENDS = {"flash_attn_4": _flash_attn_4, "cudnn": _cudnn, "flash_attn": _flash_attn_pkg,
                 "flash": _flash_aten}
FP8_NAME = "fa3_fp8"                     # --attention-backend fa3-fp8: opt-in only, never chosen by auto
FP8_KERNEL = AttentionBackend(FP8_NAME, fa3_fp8_attention, fp8=True)
FP8_MIN_PAIRS = 1 << 24                  # on CUDA fewer visible (query, key) pairs than this run the bf16 kernel


def fp8_backend(fallback: AttentionBackend) -> AttentionBackend:
    """--attention-backend fa3-fp8: FP8 attention (kernels/fa3_fp8.py). On CUDA a call of fewer than FP8_MIN_PAIRS
    visible pairs, square or unmasked, runs `fallback` (bf16) instead: there the operands' casts cost more than
    the FP8 kernel saves (docs/benchmarks.md, FP8 attention). Elsewhere every call is FP8 (the tests' path)."""
    def attend(q, k, v, causal, scale):
        sq, sk = q.shape[0], k.shape[0]
        pairs = sq * (sk - sq) + sq * (sq + 1) // 2 if causal else sq * sk
        if q.is_cuda and pairs < FP8_MIN_PAIRS and (not causal or sq == sk):
            return fallback.fn(q, k, v, causal, scale)
        return fa3_fp8_attention(q, k, v, causal, scale)
    return AttentionBackend(FP8_NAME, attend, fp8=True)


# flash-attn-4 compiles each kernel configuration on its first call (seconds). Its persistent cache,
# off by default, keeps them where a restarted server finds them; it reads these at import.
FA4_CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "burstserve", "flash-attn-cute")


def enable_fa4_compile_cache() -> None:
    """Turns flash-attn-4's persistent compile cache on (at FA4_CACHE_DIR) unless the user set it."""
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", FA4_CACHE_DIR)


def available_backends(device: torch.device) -> list[str]:
    """Backends that may run on this device, fastest first (docs/benchmarks.md, Kernels): flash-attn-4 on
    SM90+, then cuDNN, flash_attn 2.x if installed, PyTorch's FA2."""
    if device.type != "cuda":
        return ["flash", "reference"]
    names = []
    if torch.cuda.get_device_capability(device)[0] >= 9:
        enable_fa4_compile_cache()
        try:
            import flash_attn.cute  # noqa: F401
            names.append("flash_attn_4")
        except Exception as e:  # ImportError, or a CuTe-DSL install that does not load
            log.info("attention backend flash_attn_4 unavailable: %s", e)
    names.append("cudnn")
    try:
        from flash_attn import flash_attn_func  # noqa: F401  (flash_attn 2.x; flash-attn-4 lacks it)
        names.append("flash_attn")
    except Exception:
        pass
    return names + ["flash", "reference"]


# --attention-backend (serve, bench, LLM(attention_backend=...)) -> the backend's name here
ATTENTION_BACKENDS = {"auto": "auto", "flash-attn": "flash_attn_4", "cudnn": "cudnn", "flash": "flash",
                      "reference": "reference", "fa3-fp8": "fa3_fp8"}


def backend_refusal(option: str, devices: list[str]) -> str | None:
    """Why `--attention-backend option` cannot run on `devices` (None: it may; the workers still probe
    it against the reference at start). Checked before any worker starts."""
    if option not in ATTENTION_BACKENDS:
        return f"--attention-backend {option!r} is not one of {', '.join(ATTENTION_BACKENDS)}"
    if option in ("auto", "reference"):
        return None
    device = torch.device(devices[0])
    if option == "fa3-fp8":
        return fa3_fp8_refusal(device)
    if device.type != "cuda" and option != "flash":
        return (f"--attention-backend {option} needs CUDA GPUs, but the devices are {devices[0]}; use auto, flash "
                "or reference")
    if option == "flash-attn":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 9:
            return f"--attention-backend flash-attn (flash-attn-4) needs SM90 or newer; {device} is sm_{major}{minor}"
        try:
            import flash_attn.cute  # noqa: F401
        except Exception as e:
            return (f"--attention-backend flash-attn needs flash-attn-4 (pip install 'burstserve[flash-attn]'), "
                    f"which does not import here: {e}")
    return None


def select_backend(device: torch.device, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                   head_dim: int, requested: str = "auto") -> AttentionBackend:
    """The first backend that runs and agrees with the reference on a small probe of these shapes."""
    enable_fa4_compile_cache()
    names = available_backends(device) if requested == "auto" else [requested]
    for name in names:
        if name == "reference":
            return AttentionBackend("reference", reference_attention)
        backend = FP8_KERNEL if name == FP8_NAME else AttentionBackend(name, _GPU_BACKENDS[name])
        started = time.perf_counter()
        if _probe(backend, device, dtype, num_heads, num_kv_heads, head_dim):   # also compiles its kernels
            log.info("attention backend %s on %s: probed (causal, full and decode blocks, %d/%d heads, d %d) "
                     "and warmed up in %.2f s", name, device, num_heads, num_kv_heads, head_dim,
                     time.perf_counter() - started)
            if name == FP8_NAME:          # small calls on CUDA: the best bf16 backend
                return fp8_backend(select_backend(device, dtype, num_heads, num_kv_heads, head_dim))
            return backend
        if requested != "auto":
            raise ValueError(f"attention kernel {name!r} does not run on {device} with {dtype}, d={head_dim}")
    raise RuntimeError("no attention backend")


def _disagrees(backend: AttentionBackend, out, lse, ref_out, ref_lse) -> bool:
    """Beyond the backend's rounding: bf16's 2e-2 an element, 1e-2 on the LSE; fp32's 1e-4 on both (a kernel
    that multiplies in TF32, as cuDNN does, or returns NaN for fp32 inputs, as cuDNN's SDPA did on an H100 on
    2026-12-07, is not an fp32 kernel); FP8's e4m3 (3 mantissa bits) 0.1 relative over the block, 0.25 on the
    LSE (its scores are rounded too). Written as `not (error <= tolerance)`: a NaN disagrees."""
    lse_err = (lse - ref_lse).abs().max()
    if backend.fp8:
        rel = (out.float() - ref_out.float()).norm() / ref_out.float().norm().clamp(min=1e-30)
        return not (bool(rel <= 0.1) and bool(lse_err <= 0.25))
    out_tol, lse_tol = (1e-4, 1e-4) if ref_out.dtype == torch.float32 else (2e-2, 1e-2)
    return not (bool((out.float() - ref_out.float()).abs().max() <= out_tol) and bool(lse_err <= lse_tol))


def _probe(backend: AttentionBackend, device, dtype, h: int, hkv: int, d: int) -> bool:
    """Runs the layouts the engine uses (K/V as views of a packed [S, 2, Hkv, D] block; a one-row
    decode query) and compares with the reference."""
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(256, h, d, device=device, dtype=dtype, generator=gen)
        kv = torch.randn(256, 2, hkv, d, device=device, dtype=dtype, generator=gen)
        for rows, causal in ((256, True), (256, False), (1, False)):
            out, lse = backend(q[:rows], kv[:, 0], kv[:, 1], causal, d ** -0.5)
            ref_out, ref_lse = reference_attention(q[:rows], kv[:, 0], kv[:, 1], causal, d ** -0.5)
            if _disagrees(backend, out, lse, ref_out, ref_lse):
                log.warning("attention backend %s disagrees with the reference; skipped", backend.name)
                return False
        return True
    except Exception as e:  # a backend that cannot run these shapes is skipped, with the reason logged
        log.info("attention backend %s unavailable: %s", backend.name, e)
        return False
