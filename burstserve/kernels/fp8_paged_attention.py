"""Decode attention over FP8 pages (kernels/kv_quant.py): one new token per sequence against its paged K/V,
read as float8_e4m3fn with a bf16 scale per (token, KV head), in one Triton kernel plus the LSE merge.

    fp8_paged_decode(q, k_pages, v_pages, block_table, seq_lens, scale, num_splits=None)
        -> (out [B, H, D] in q's dtype, lse [B, H] fp32, natural log)

q [B, H, D] (bf16 or fp16); k_pages, v_pages: Fp8Pages ([num_blocks, block_size, Hkv, D] uint8 and
[num_blocks, block_size, Hkv] bf16 scales); block_table [B, max_blocks] int32; seq_lens [B] int32
(0: a padding row, out 0 and lse -inf).

One program per (sequence, KV head, split): the QPK = H / Hkv query heads of the KV head (packed GQA,
padded to 16 rows for the tensor cores), over split s's pages of the sequence: its own pages cut into
`num_splits` runs from its length on the device (a CUDA graph captured for the table's capacity still
splits each sequence's actual keys). A page's K and V tiles are loaded as FP8 bytes, turned into the
compute dtype exactly (4 significant bits), and their scales applied to the scores' columns (K) and to
the probabilities' columns (V) in fp32: the same values as attention over the dequantized pages. The
splits' partials (fp32) merge by LSE (kernels.merge.merge_partials). The number of splits is chosen
from the shapes alone, as the flash-attn-4 path's (paged_attention.choose_num_chunks). Nothing is read
on the host, so a CUDA graph can capture it.

The torch ops (`fp8_paged_decode_reference`: the pages gathered and dequantized, then attention in fp32)
are the reference and run where Triton does not (the CPU).
"""
import torch

from burstserve.kernels.arith import ceil_div
from burstserve.kernels.kv_quant import Fp8Pages
from burstserve.kernels.merge import merge_partials
from burstserve.kernels.triton_setup import LazyTriton

tl = None             # triton.language, bound by _build (the kernel resolves it as a global)
_tile_scales = _tile_rows = _attend_tile = None   # the kernel's helpers, jitted by _build (globals too)

LOG2E = 1.4426950408889634
MIN_SPLIT_KEYS = 512      # a split covers at least this many keys (fewer: the launch and the merge dominate)
MAX_SPLITS = 128          # above 4 waves' 66 a sequence and KV head on 132 SMs (64 left 16 program slots idle)
QPAD_MIN = 16             # tl.dot's smallest M


def fp8_paged_decode(q: torch.Tensor, k_pages: Fp8Pages, v_pages: Fp8Pages, block_table: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float, num_splits: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. num_splits: None chooses from the shapes (host-known only)."""
    kern = _triton.kernels(q.device)
    if kern is not None:
        try:
            return _decode_triton(kern["decode"], q, k_pages, v_pages, block_table, seq_lens, scale, num_splits)
        except Exception as e:      # compile or launch failure: the torch ops from now on
            _triton.failed(e)
    return fp8_paged_decode_reference(q, k_pages, v_pages, block_table, seq_lens, scale)


def choose_splits(batch: int, num_kv_heads: int, max_keys: int, num_sms: int, waves: int = 3) -> int:
    """Splits per (sequence, KV head) so that the programs about fill the SMs `waves` times over, each split
    at least MIN_SPLIT_KEYS of the table's capacity (host-known, so the choice holds under CUDA graphs)."""
    by_sms = waves * num_sms // max(batch * num_kv_heads, 1)
    return max(1, min(by_sms, max_keys // MIN_SPLIT_KEYS, MAX_SPLITS))


# ---------------------------------------------------------------- torch (the reference, and off CUDA)

def fp8_paged_decode_reference(q, k_pages, v_pages, block_table, seq_lens, scale):
    """The pages gathered and dequantized, attention in fp32 -> (out [B, H, D] in q's dtype, lse [B, H])."""
    b, h, d = q.shape
    bs, hkv = k_pages.shape[1], k_pages.shape[2]
    out = torch.zeros(b, h, d, dtype=q.dtype, device=q.device)
    lse = torch.full((b, h), float("-inf"), dtype=torch.float32, device=q.device)
    for i, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        blocks = block_table[i, :ceil_div(n, bs)].long()
        k = k_pages.gather(blocks, n, torch.float32).repeat_interleave(h // hkv, dim=1)     # [n, H, D]
        v = v_pages.gather(blocks, n, torch.float32).repeat_interleave(h // hkv, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale                         # [H, n]
        lse[i] = torch.logsumexp(scores, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v).to(q.dtype)
    return out, lse


# ---------------------------------------------------------------- Triton

def _decode_triton(kernel, q, k_pages, v_pages, block_table, seq_lens, scale, num_splits, num_warps=2,
                   num_stages=2, waves=4, block_keys=64):
    """The launch's settings are the fastest measured on Hopper GPUs at 1 x 128K, 16 x 8K and 1 x 1M
    (docs/benchmarks.md, "FP8 KV cache"): 2-warp programs over tiles of 64 keys, 4 waves of them, 2 pipeline
    stages (3 took as long or longer). block_keys: smaller tiles for pages smaller than the GPU's (the tests);
    scripts/hopper_codegen.py compiles the kernel with these defaults."""
    b, h, d = q.shape
    _, bs, hkv, _ = k_pages.shape
    qpk = h // hkv
    if num_splits is None:
        num_splits = choose_splits(b, hkv, block_table.shape[1] * bs,
                                   torch.cuda.get_device_properties(q.device).multi_processor_count, waves)
    if q.stride(2) != 1:
        q = q.contiguous()
    seq_lens = seq_lens.to(torch.int32)
    outs = torch.empty(num_splits, b, h, d, dtype=torch.float32, device=q.device)
    lses = torch.empty(num_splits, b, h, dtype=torch.float32, device=q.device)
    kernel[(b, hkv, num_splits)](
        q, k_pages.data, v_pages.data, k_pages.scale, v_pages.scale, block_table, seq_lens, outs, lses,
        scale * LOG2E, block_table.stride(0), num_splits, q.stride(0), q.stride(1), b,
        HKV=hkv, QPK=qpk, QPAD=max(QPAD_MIN, 1 << (qpk - 1).bit_length()), D=d, BS=bs,
        STAGES=num_stages, BN=min(block_keys, bs), num_warps=num_warps)
    return merge_partials(outs, lses, q.dtype)


def _build() -> dict:
    """jit the decode kernel. A fresh one each call: tests build an interpreted one (TRITON_INTERPRET=1)."""
    global tl
    import triton
    import triton.language as tl

    def _tile_scales_fn(table_ptr, ks_ptr, vs_ptr, b, g, t, end, table_stride, HKV: tl.constexpr, BS: tl.constexpr,
                        BN: tl.constexpr):
        """Key tile t's K and V scales [BN] (fp32) when t < end, else page 0's (read, never used)."""
        tiles = BS // BN
        page = tl.load(table_ptr + b.to(tl.int64) * table_stride + t // tiles, mask=t < end, other=0).to(tl.int64)
        row = (page * BS + (t % tiles) * BN + tl.arange(0, BN)) * HKV + g
        return tl.load(ks_ptr + row).to(tl.float32), tl.load(vs_ptr + row).to(tl.float32)

    def _tile_rows_fn(table_ptr, b, g, t, table_stride, HKV: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr):
        """Key tile t's rows [BN] of the pages' (slot, KV head) rows."""
        tiles = BS // BN
        page = tl.load(table_ptr + b.to(tl.int64) * table_stride + t // tiles).to(tl.int64)
        return (page * BS + (t % tiles) * BN + tl.arange(0, BN)) * HKV + g

    def _attend_tile_fn(q, k, v, k_scale, v_scale, valid, m, l, acc, scale2, MASKED: tl.constexpr):
        """One key tile into the running partial: q [QPAD, D] (fp16 or fp32), k, v [BN, D] e4m3 bits, their
        scales [BN] fp32 (0 past the sequence), valid [BN], scale2 the softmax scale times log2(e) -> (m, l
        [QPAD], acc [QPAD, D]) fp32, m in base 2 (exp2 takes no multiply, where exp takes one). MASKED: the
        tile has slots past the sequence; they hold stale bytes (NaN patterns too), so their scores and V's
        values there are replaced, never multiplied by 0. A whole tile skips that (128 selects a thread)."""
        k = k.to(tl.float8e4nv, bitcast=True).to(q.dtype)                          # exact: 4 significant bits
        # K @ Q^T: the tile's keys are the MMA's M side, its few query rows the narrow N side
        scores = tl.trans(tl.dot(k, tl.trans(q))) * (k_scale * scale2)[None, :]     # [QPAD, BN] fp32, base 2
        if MASKED:
            scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))                              # a tile has a key: finite
        alpha = tl.exp2(m - m_new)
        prob = tl.exp2(scores - m_new[:, None])
        l = l * alpha + tl.sum(prob, axis=1)
        v = v.to(tl.float8e4nv, bitcast=True).to(q.dtype)
        if MASKED:
            v = tl.where(valid[:, None], v, 0.0)
        # V's scales on the probabilities' columns, relative to the tile's largest (<= 1: no overflow in
        # fp16; a row 2^-24 below the largest is lost, as its values are against the largest's)
        top = tl.maximum(tl.max(v_scale, axis=0), 1e-30)
        weights = (prob * (v_scale / top)[None, :]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(weights, v) * top
        return m_new, l, acc

    def decode_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, out_ptr, lse_ptr,
                      scale2, table_stride, splits, q_stride_b, q_stride_h, batch,
                      HKV: tl.constexpr, QPK: tl.constexpr, QPAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                      STAGES: tl.constexpr, BN: tl.constexpr):
        """Program (sequence b, KV head g, split s): the partial (out, lse) of the KV head's query heads over
        split s's pages, written at [s, b, heads] of out [S, B, H, D] and lse [S, B, H] (fp32)."""
        b = tl.program_id(0)
        g = tl.program_id(1)
        s = tl.program_id(2)
        n = tl.load(lens_ptr + b)
        pages = (n + BS - 1) // BS
        per = (pages + splits - 1) // splits
        first = s * per
        last = tl.minimum(first + per, pages)
        rows = tl.arange(0, QPAD)
        head = g * QPK + rows                                                      # [QPAD]
        row_ok = rows < QPK
        cols = tl.arange(0, D)
        q = tl.load(q_ptr + b.to(tl.int64) * q_stride_b + head[:, None] * q_stride_h + cols[None, :],
                    mask=row_ok[:, None], other=0.0)                               # [QPAD, D]
        # the dots in fp16 (fp32 for fp32 queries): an FP8 value becomes fp16 exactly in one instruction per
        # pair, where bf16 takes several (the conversions bound the kernel), and bf16 queries are exact in
        # fp16 within its range
        q = q.to(tl.float32 if q.dtype == tl.float32 else tl.float16)
        m = tl.full([QPAD], float("-inf"), tl.float32)
        l = tl.zeros([QPAD], tl.float32)
        acc = tl.zeros([QPAD, D], tl.float32)
        slot = tl.arange(0, BN)
        tiles = BS // BN                                                           # key tiles a page
        start = first * tiles
        end = tl.minimum(last * tiles, (n + BN - 1) // BN)
        whole = tl.minimum(end, n // BN)                                           # tiles [start, whole): full
        # the scales are 2-byte loads 16 bytes apart (one a slot and KV head), which Triton's pipeliner does
        # not copy ahead like the K/V tiles: each tile's are asked for one iteration before it (else every
        # tile waits a memory round trip for them)
        k_scale_next, v_scale_next = _tile_scales(table_ptr, ks_ptr, vs_ptr, b, g, start, whole, table_stride,
                                                  HKV, BS, BN)
        for t in tl.range(start, whole, num_stages=STAGES):
            row = _tile_rows(table_ptr, b, g, t, table_stride, HKV, BS, BN)       # [BN]: (slot, head) rows
            # unmasked loads (masked, Triton reads V's bytes from shared memory one at a time for the dot)
            k = tl.load(k_ptr + row[:, None] * D + cols[None, :])                 # [BN, D] e4m3 bits
            v = tl.load(v_ptr + row[:, None] * D + cols[None, :])
            k_scale, v_scale = k_scale_next, v_scale_next
            k_scale_next, v_scale_next = _tile_scales(table_ptr, ks_ptr, vs_ptr, b, g, t + 1, whole, table_stride,
                                                      HKV, BS, BN)
            m, l, acc = _attend_tile(q, k, v, k_scale, v_scale, slot < BN, m, l, acc, scale2, False)
        t = tl.maximum(whole, start)
        if t < end:    # the sequence's last tile, part-filled (its page's later slots are stale)
            row = _tile_rows(table_ptr, b, g, t, table_stride, HKV, BS, BN)
            valid = t * BN + slot < n
            k = tl.load(k_ptr + row[:, None] * D + cols[None, :])
            v = tl.load(v_ptr + row[:, None] * D + cols[None, :])
            k_scale, v_scale = _tile_scales(table_ptr, ks_ptr, vs_ptr, b, g, t, end, table_stride, HKV, BS, BN)
            m, l, acc = _attend_tile(q, k, v, tl.where(valid, k_scale, 0.0), tl.where(valid, v_scale, 0.0), valid,
                                     m, l, acc, scale2, True)
        has = l > 0
        out = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
        lse = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * 0.6931471805599453, float("-inf"))   # x ln 2
        at = (s * batch + b).to(tl.int64) * (HKV * QPK) + head                     # [QPAD] rows of [S, B, H]
        tl.store(out_ptr + at[:, None] * D + cols[None, :], out, mask=row_ok[:, None])
        tl.store(lse_ptr + at, lse, mask=row_ok)

    nospec = ["table_stride", "splits", "q_stride_b", "q_stride_h", "batch"]
    global _tile_scales, _tile_rows, _attend_tile
    _tile_scales = triton.jit(_tile_scales_fn)
    _tile_rows = triton.jit(_tile_rows_fn)
    _attend_tile = triton.jit(_attend_tile_fn)
    return {"decode": triton.jit(decode_kernel, do_not_specialize=nospec)}


_triton = LazyTriton(_build, "fp8-paged-attention")
