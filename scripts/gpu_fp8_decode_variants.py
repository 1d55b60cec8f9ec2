"""Where the FP8 paged decode kernel's time goes, and which reshaping of it reads its bytes faster: variants of
kernels/fp8_paged_attention.py's loop, one layer with llama3-8b's attention shapes (32 query heads, 8 KV heads,
d 128, pages of 128), each call replayed in a CUDA graph, beside the kernel as it is and flash-attn-4's bf16
paged decode on the same values.

Variants (one Triton kernel, chosen by constexprs; `kernel` is the kernel itself at each launch setting):
    loads        the loop's loads only, xor-ed into registers 4 bytes at a time: what the access pattern allows
    stream       the loop's loads only (K, V bytes and their scales), summed: what the access pattern allows
    stream_cvt   the loads and the FP8 -> fp16 conversions, summed: what the conversions cost
    unmasked     the kernel's loop with its K/V loads unmasked (the stale slots of a sequence's last page
                 replaced after the load): Triton then converts V to fp16 before its shared-memory copy,
                 where with masked loads it reads V's bytes from shared memory one at a time
    scales_hm    the scales read from a copy stored head-major within a page ([blocks, Hkv, block] bf16)
    kt           the scores as K @ Q^T (K the MMA's M side: 128 keys a tile, the warp-group MMA's shape)
    q8_kt        kt with Q rounded to e4m3, one scale a row: the scores an FP8 x FP8 warp-group MMA (no
                 conversion of K)
    kt_ahead, q8_kt_ahead   kt, q8_kt with scales_ahead's scales (the loop as the kernel has it since 20c833e)
    q8x2_kt_ahead    q8_kt_ahead with Q's rounding remainder as a second e4m3 operand (16x up): two FP8 MMAs
                 for the scores, Q kept to ~8 significant bits (bf16's), K still not converted
    vs           V's scales applied to V's rows (products rounded to fp16) instead of the probabilities
    vt           V's pages stored transposed ([blocks, Hkv, D, block]) in a copy
    scales_unmasked  unmasked, its scales loaded unmasked too (replaced after the load)
    scales_ahead     unmasked, each tile's scales asked for one iteration ahead (the kernel's way since 20c833e)
    scales_ahead_hm, scales_ahead_vs   scales_ahead with scales_hm's layout, with vs's arithmetic
    kt_noexp, kt_noreduce, kt_nosel   ablations of kt_ahead, for timing only (wrong values): the
                 probabilities without exp; without the max and sum over the keys; V's stale slots not replaced
    ktt          kt_ahead with both dots transposed: P.V as V^T @ P^T, the softmax over the keys' axis of the
                 [keys, query rows] scores, the output transposed once after the loop (no register
                 transposes in the loop)
    kt_fastcvt   kt_ahead with K and V made fp16 by byte permutes, a shift and a mask (FlashInfer's fast_dequant
                 way: the byte becomes the fp16's high byte, so the value comes out / 256, folded into the
                 scales) instead of the conversion instruction (cvt.rn.f16x2.e4m3x2)
(folder 1-variants ran this script's first version: stream to vt, their K/V loads unmasked as here, their
scales loaded with a mask as `unmasked`'s)

    [VARIANTS=a,b,...] [SETTINGS="w,s,bn,waves ..."] python scripts/gpu_fp8_decode_variants.py [BATCHxCONTEXT ...]
    default: 1x131072 16x8192; SETTINGS (warps, stages, keys a tile, waves) replaces the 12 below

Prints a table (time per call, KV bytes read per second, max abs difference from fp32 attention over the same
rounded K/V); writes fp8_decode_variants.json under $OUT (or the working directory).
"""
import inspect
import json
import os
import sys

import torch
import triton
import triton.language as tl

from kernels import fp8_paged_attention as fpa
from kernels.fp8_paged_attention import fp8_paged_decode_reference
from kernels.kv_quant import SCALE_BYTES
from kernels.merge import merge_partials
from kernels.paged_attention import paged_attention

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_fp8_decode import BS, D, HKV, make  # noqa: E402
from gpu_kernel_timing import graph_us  # noqa: E402

VARIANTS = {   # name: (MODE, KT, Q8, SCALES_HM, VT, VS, SCALES[, FASTCVT[, ABL]])
    "loads": (3, 0, 0, 0, 0, 0, 0),
    "stream": (1, 0, 0, 0, 0, 0, 0),
    "stream_cvt": (2, 0, 0, 0, 0, 0, 0),
    "unmasked": (0, 0, 0, 0, 0, 0, 0),
    "scales_hm": (0, 0, 0, 1, 0, 0, 0),
    "kt": (0, 1, 0, 0, 0, 0, 0),
    "q8_kt": (0, 1, 1, 0, 0, 0, 0),
    "vs": (0, 0, 0, 0, 0, 1, 0),
    "vt": (0, 0, 0, 0, 1, 0, 0),
    "scales_unmasked": (0, 0, 0, 0, 0, 0, 1),
    "scales_ahead": (0, 0, 0, 0, 0, 0, 2),
    "scales_ahead_hm": (0, 0, 0, 1, 0, 0, 2),
    "scales_ahead_vs": (0, 0, 0, 0, 0, 1, 2),
    "kt_ahead": (0, 1, 0, 0, 0, 0, 2),
    "q8_kt_ahead": (0, 1, 1, 0, 0, 0, 2),
    "q8x2_kt_ahead": (0, 1, 2, 0, 0, 0, 2),
    "kt_fastcvt": (0, 1, 0, 0, 0, 0, 2, 1),
    "ktt": (0, 2, 0, 0, 0, 0, 2),
    "kt_noexp": (0, 1, 0, 0, 0, 0, 2, 0, 1),
    "kt_noreduce": (0, 1, 0, 0, 0, 0, 2, 0, 2),
    "kt_nosel": (0, 1, 0, 0, 0, 0, 2, 0, 3),
}
# the second run's (docs/results/2026-11-26-1xH100-fp8-decode-scales-ahead/2-variants); VARIANTS=a,b,... picks
DEFAULT_VARIANTS = "loads,unmasked,scales_unmasked,scales_ahead,scales_ahead_hm,scales_ahead_vs"
SETTINGS = [   # warps, stages, keys a tile, waves of programs (splits uncapped, at least 256 keys each)
    (4, 2, 128, 2), (4, 3, 128, 2), (4, 2, 128, 8),
    (2, 2, 64, 4), (2, 3, 64, 4), (2, 3, 64, 16), (2, 3, 32, 16),
    (1, 2, 64, 8), (1, 3, 64, 8), (1, 3, 64, 32), (1, 3, 32, 32), (1, 4, 32, 32)]
# the kernel's own launch (its defaults), for its row's labels
AS_IS = tuple(inspect.signature(fpa._decode_triton).parameters[k].default
              for k in ("num_warps", "num_stages", "block_keys", "waves"))
if os.environ.get("SETTINGS"):
    SETTINGS = [tuple(int(v) for v in s.split(",")) for s in os.environ["SETTINGS"].split()]


@triton.jit
def e4m3_to_f16_over_256(x):
    """e4m3 bytes (uint8, any shape) -> fp16 of the value / 256, without the conversion instruction: two byte
    permutes put each byte in the high byte of a 16-bit lane (sign at bit 15), a shift right by one and a
    mask move its exponent and mantissa under fp16's; fp16's exponent bias is 8 more than e4m3's, hence / 256
    (exact, subnormals too). 0x7F / 0xFF (NaN in e4m3) become +-1.875: replaced by the caller like stale slots."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 z, lo, hi, s;
        mov.b32 z, 0;
        prmt.b32 lo, z, $2, 0x5140;
        prmt.b32 hi, z, $2, 0x7362;
        shr.b32 s, lo, 1;
        and.b32 s, s, 0x3F803F80;
        and.b32 lo, lo, 0x80008000;
        or.b32 $0, s, lo;
        shr.b32 s, hi, 1;
        and.b32 s, s, 0x3F803F80;
        and.b32 hi, hi, 0x80008000;
        or.b32 $1, s, hi;
        }""",
        constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def variant_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr,
                   scale, table_stride, splits, q_stride_b, q_stride_h, batch,
                   HKV: tl.constexpr, QPK: tl.constexpr, QPAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                   STAGES: tl.constexpr, BN: tl.constexpr, MODE: tl.constexpr, KT: tl.constexpr,
                   Q8: tl.constexpr, SCALES_HM: tl.constexpr, VT: tl.constexpr, VS: tl.constexpr,
                   SCALES: tl.constexpr, FASTCVT: tl.constexpr, ABL: tl.constexpr):
    b = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(lens_ptr + b)
    pages = (n + BS - 1) // BS
    per = (pages + splits - 1) // splits
    first = s * per
    last = tl.minimum(first + per, pages)
    rows = tl.arange(0, QPAD)
    head = g * QPK + rows
    row_ok = rows < QPK
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + b.to(tl.int64) * q_stride_b + head[:, None] * q_stride_h + cols[None, :],
                mask=row_ok[:, None], other=0.0).to(tl.float32)                 # [QPAD, D]
    if Q8:
        q_scale = tl.maximum(tl.max(tl.abs(q), axis=1) / 448.0, 1e-30)         # [QPAD]
        qd = (q / q_scale[:, None]).to(tl.float8e4nv)
        # Q8 == 2: the rounding's remainder as a second e4m3 operand, 16x up (Q to ~8 significant bits)
        q_lo = (((q / q_scale[:, None]) - qd.to(tl.float32)) * 16.0).to(tl.float8e4nv)
    else:
        q_scale = tl.full([QPAD], 1.0, tl.float32)
        qd = q.to(tl.float16)
    m = tl.full([QPAD], float("-inf"), tl.float32)
    l = tl.zeros([QPAD], tl.float32)
    acc = tl.zeros([QPAD, D], tl.float32)
    acc_t = tl.zeros([D, QPAD], tl.float32)                                      # KT == 2's
    sink = tl.zeros([D], tl.float32)
    cols4 = tl.arange(0, D // 4)
    bits = tl.zeros([BN, D // 4], tl.int32)
    slot = tl.arange(0, BN)
    tiles = BS // BN
    start = first * tiles
    end = tl.minimum(last * tiles, (n + BN - 1) // BN)
    # SCALES == 2: the next tile's scales asked for one iteration ahead (they are 2-byte loads 8 KV heads
    # apart, which Triton's pipeliner does not copy asynchronously)
    page0 = tl.load(table_ptr + b.to(tl.int64) * table_stride + start // tiles, mask=start < end, other=0).to(tl.int64)
    if SCALES_HM:
        srow0 = (page0 * HKV + g) * BS + (start % tiles) * BN + slot
    else:
        srow0 = (page0 * BS + (start % tiles) * BN + slot) * HKV + g
    k_scale_next = tl.load(ks_ptr + srow0).to(tl.float32)
    v_scale_next = tl.load(vs_ptr + srow0).to(tl.float32)
    for t in tl.range(start, end, num_stages=STAGES):
        page = tl.load(table_ptr + b.to(tl.int64) * table_stride + t // tiles).to(tl.int64)
        inpage = (t % tiles) * BN + slot
        row = (page * BS + inpage) * HKV + g
        valid = t * BN + slot < n
        # unmasked: the tile lies in a page of the sequence; slots past its length hold stale bytes (NaN
        # patterns too), so the scores and V's values there are replaced, not multiplied by zero
        if MODE != 3:
            k = tl.load(k_ptr + row[:, None] * D + cols[None, :])
        if MODE == 3:
            pass
        elif VT:   # V's page stored [Hkv, D, BS]: a head's tile is D rows of BS keys
            v = tl.load(v_ptr + ((page * HKV + g) * D + cols[None, :]) * BS + inpage[:, None])
        else:
            v = tl.load(v_ptr + row[:, None] * D + cols[None, :])
        if SCALES_HM:
            srow = (page * HKV + g) * BS + inpage
        else:
            srow = row
        if SCALES == 2:
            k_scale = k_scale_next
            v_scale = v_scale_next
            tn = t + 1
            page_n = tl.load(table_ptr + b.to(tl.int64) * table_stride + tn // tiles, mask=tn < end,
                             other=0).to(tl.int64)
            if SCALES_HM:
                srow_n = (page_n * HKV + g) * BS + (tn % tiles) * BN + slot
            else:
                srow_n = (page_n * BS + (tn % tiles) * BN + slot) * HKV + g
            k_scale_next = tl.load(ks_ptr + srow_n).to(tl.float32)
            v_scale_next = tl.load(vs_ptr + srow_n).to(tl.float32)
        elif SCALES == 1:    # unmasked
            k_scale = tl.load(ks_ptr + srow).to(tl.float32)
            v_scale = tl.load(vs_ptr + srow).to(tl.float32)
        else:
            k_scale = tl.load(ks_ptr + srow, mask=valid, other=0.0).to(tl.float32)
            v_scale = tl.load(vs_ptr + srow, mask=valid, other=0.0).to(tl.float32)
        k_scale = tl.where(valid, k_scale, 0.0)      # stale slots' scales may be NaN patterns
        v_scale = tl.where(valid, v_scale, 0.0)
        if MODE == 1:
            sink += tl.sum(k.to(tl.float32), axis=0) + tl.sum(v.to(tl.float32), axis=0) + tl.sum(k_scale + v_scale)
        elif MODE == 3:   # the loads alone: 4 bytes at a time, xor-ed into registers (no reduction in the loop)
            w = (page * BS + inpage) * HKV + g
            k4 = tl.load(k_ptr.to(tl.pointer_type(tl.int32)) + w[:, None] * (D // 4) + cols4[None, :])
            v4 = tl.load(v_ptr.to(tl.pointer_type(tl.int32)) + w[:, None] * (D // 4) + cols4[None, :])
            bits ^= k4 ^ v4 ^ (k_scale + v_scale).to(tl.int32)[:, None]
        elif KT == 2:   # everything transposed: keys the MMAs' wide side in both dots, no register transposes
            kq = k.to(tl.float8e4nv, bitcast=True).to(tl.float16)
            scores_t = tl.dot(kq, tl.trans(qd)) * (k_scale * scale)[:, None]          # [BN, QPAD] fp32
            scores_t = tl.where(valid[:, None], scores_t, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores_t, axis=0))
            alpha = tl.exp(m - m_new)
            prob_t = tl.exp(scores_t - m_new[None, :])
            l = l * alpha + tl.sum(prob_t, axis=0)
            vh = tl.where(valid[:, None], v.to(tl.float8e4nv, bitcast=True).to(tl.float16), 0.0)   # [BN, D]
            top = tl.maximum(tl.max(v_scale, axis=0), 1e-30)
            w_t = (prob_t * (v_scale / top)[:, None]).to(tl.float16)                   # [BN, QPAD]
            acc_t = acc_t * alpha[None, :] + tl.dot(tl.trans(vh), w_t) * top           # [D, QPAD]
            m = m_new
        elif MODE == 2:
            kh = k.to(tl.float8e4nv, bitcast=True).to(tl.float16).to(tl.float32)
            vh = v.to(tl.float8e4nv, bitcast=True).to(tl.float16).to(tl.float32)
            sink += tl.sum(kh, axis=0) + tl.sum(vh, axis=0) + tl.sum(k_scale + v_scale)
        else:
            k8 = k.to(tl.float8e4nv, bitcast=True)
            if Q8:
                kq = k8
            elif FASTCVT:
                kq = e4m3_to_f16_over_256(k)                                    # K / 256
            else:
                kq = k8.to(tl.float16)
            if KT:
                scores_t = tl.dot(kq, tl.trans(qd))                             # [BN, QPAD] fp32
                if Q8 == 2:
                    scores_t += tl.dot(kq, tl.trans(q_lo)) * 0.0625
                scores = tl.trans(scores_t)
            else:
                scores = tl.dot(qd, tl.trans(kq))
            scores = scores * (k_scale * scale * (256.0 if FASTCVT else 1.0))[None, :] * q_scale[:, None]
            scores = tl.where(valid[None, :], scores, float("-inf"))
            if ABL == 2:     # no reductions over the keys
                m_new = m
                alpha = tl.full([QPAD], 1.0, tl.float32)
                prob = tl.exp(scores * 0.01)
                l = l + 1.0
            else:
                m_new = tl.maximum(m, tl.max(scores, axis=1))
                alpha = tl.exp(m - m_new)
                if ABL == 1:     # no exp
                    prob = tl.where(valid[None, :], scores - m_new[:, None], 0.0)
                else:
                    prob = tl.exp(scores - m_new[:, None])
                l = l * alpha + tl.sum(prob, axis=1)
            if VS:   # V's scales on V's rows, in fp16 (rounds the product to 11 bits)
                vh = (v.to(tl.float8e4nv, bitcast=True).to(tl.float32) * v_scale[:, None]).to(tl.float16)
                vh = tl.where(valid[:, None], vh, 0.0)
                acc = acc * alpha[:, None] + tl.dot(prob.to(tl.float16), vh)
            else:
                if FASTCVT:
                    vh = tl.where(valid[:, None], e4m3_to_f16_over_256(v), 0.0)                # V / 256
                elif ABL == 3:   # stale slots not replaced
                    vh = v.to(tl.float8e4nv, bitcast=True).to(tl.float16)
                else:
                    vh = tl.where(valid[:, None], v.to(tl.float8e4nv, bitcast=True).to(tl.float16), 0.0)
                top = tl.maximum(tl.max(v_scale, axis=0), 1e-30)
                weights = (prob * (v_scale / top)[None, :]).to(tl.float16)
                acc = acc * alpha[:, None] + tl.dot(weights, vh) * (top * (256.0 if FASTCVT else 1.0))
            m = m_new
    if KT == 2:
        acc = tl.trans(acc_t)
    if MODE == 3:
        sink += tl.sum(tl.sum(bits, axis=1), axis=0).to(tl.float32)
    if MODE != 0:
        acc += sink[None, :]
        l += 1.0
        m = tl.zeros([QPAD], tl.float32)
    has = l > 0
    out = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
    lse = tl.where(has, m + tl.log(tl.where(has, l, 1.0)), float("-inf"))
    at = (s * batch + b).to(tl.int64) * (HKV * QPK) + head
    tl.store(out_ptr + at[:, None] * D + cols[None, :], out, mask=row_ok[:, None])
    tl.store(lse_ptr + at, lse, mask=row_ok)


LAST = {}      # the last launch's compiled kernel (its registers, spills and shared memory)


def occupancy(kernel, warps) -> str:
    """regs / spills / shared KB, and the programs an SM can hold by registers and by shared memory."""
    if kernel is None:
        return "-"
    regs, spills, smem = kernel.n_regs, kernel.n_spills, kernel.metadata.shared
    by_regs = 65536 // max(1, regs * 32 * warps)
    by_smem = 232448 // max(1, smem + 1024)
    return f"{regs} / {spills} / {smem / 1024:.0f} KB: {min(by_regs, by_smem, 32)} ({by_regs} regs, {by_smem} smem)"


def launch(variant, q, k8, v8, scales_hm, v_t, table, lens, warps, stages, bn, waves=2):
    mode, kt, q8, shm, vt, vs_, scales, fastcvt, abl = (VARIANTS[variant] + (0, 0))[:9]
    b, h, d = q.shape
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = max(1, min(waves * sms // (b * HKV), table.shape[1] * BS // 256))
    outs = torch.empty(splits, b, h, d, dtype=torch.float32, device=q.device)
    lses = torch.empty(splits, b, h, dtype=torch.float32, device=q.device)
    ks, vs = scales_hm if shm else (k8.scale, v8.scale)
    LAST["kernel"] = variant_kernel[(b, HKV, splits)](
        q, k8.data, v_t if vt else v8.data, ks, vs, table, lens, outs, lses, D ** -0.5, table.stride(0), splits,
        q.stride(0), q.stride(1), b, HKV=HKV, QPK=h // HKV, QPAD=16, D=d, BS=BS, STAGES=stages, BN=bn,
        MODE=mode, KT=kt, Q8=q8, SCALES_HM=shm, VT=vt, VS=vs_, SCALES=scales, FASTCVT=fastcvt, ABL=abl, num_warps=warps)
    return merge_partials(outs, lses, q.dtype)


def main(argv: list[str]) -> None:
    shapes = [tuple(int(x) for x in a.split("x")) for a in (argv or ["1x131072", "16x8192"])]
    rows = []
    print("| variant | batch x context | warps | stages | keys a tile | waves | us | TB/s | max abs vs fp32 | "
          "regs / spills / shared: programs an SM holds |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for b, n in shapes:
        q, ((k8, kb), (v8, vb)), table, lens = make(b, n)
        scales_hm = tuple(x.scale.transpose(1, 2).contiguous() for x in (k8, v8))   # [blocks, Hkv, BS]
        v_t = v8.data.permute(0, 2, 3, 1).contiguous()                                # [blocks, Hkv, D, BS]
        ref, _ = fp8_paged_decode_reference(q, k8, v8, table, lens, D ** -0.5)
        ref = ref.float()
        kv_bytes = b * n * HKV * 2 * (D + SCALE_BYTES)

        def show(name, warps, stages, bn, waves, fn, bytes_read=kv_bytes):
            LAST.clear()
            try:
                us, (out, _) = graph_us(fn)
                err = (out.float() - ref).abs().max().item()
            except Exception as e:
                print(f"| {name} | {b} x {n} | {warps} | {stages} | {bn} | {waves} | - | {type(e).__name__}: "
                      f"{str(e)[:80]} | |", flush=True)
                return
            tbps = bytes_read / (us * 1e-6) / 1e12
            occ = occupancy(LAST.get("kernel"), warps)
            rows.append({"variant": name, "batch": b, "context": n, "warps": warps, "stages": stages, "bn": bn,
                         "waves": waves,
                         "us": us, "TBps": tbps, "max_abs_vs_fp32": err, "occupancy": occ})
            print(f"| {name} | {b} x {n} | {warps} | {stages} | {bn} | {waves} | {us:.1f} | {tbps:.2f} | {err:.2e} | "
                  f"{occ} |", flush=True)

        as_is = lambda: fpa.fp8_paged_decode(q, k8, v8, table, lens, D ** -0.5)   # noqa: E731
        graph_us(as_is)     # a throwaway first timing: a shape's first ran 2-7% slow (gpu_fp8_decode_gap.py)
        show("kernel (as is)", *AS_IS, as_is)
        cu = torch.arange(b + 1, dtype=torch.int32, device="cuda")
        show("flash-attn-4 bf16", "-", "-", "-", "-",
             lambda: paged_attention(q, kb, vb, table, cu, lens, D ** -0.5, causal=False, max_seqlen_q=1),
             bytes_read=b * n * HKV * 2 * D * 2)
        for variant in os.environ.get("VARIANTS", DEFAULT_VARIANTS).split(","):
            for warps, stages, bn, waves in SETTINGS:
                if variant == "kernel":     # the kernel itself at this launch
                    fn = lambda: fpa.fp8_paged_decode(q, k8, v8, table, lens, D ** -0.5,   # noqa: E731
                                                      num_warps=warps, num_stages=stages, block_keys=bn, waves=waves)
                else:
                    fn = lambda: launch(variant, q, k8, v8, scales_hm, v_t, table, lens,   # noqa: E731
                                        warps, stages, bn, waves)
                show(variant, warps, stages, bn, waves, fn)
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "fp8_decode_variants.json"), "w") as fh:
        json.dump({"device": torch.cuda.get_device_name(0), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
