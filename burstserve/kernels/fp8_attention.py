"""Prefill attention in FP8 over FP8 K/V (kernels/kv_quant.py: e4m3 with a bf16 scale per token and KV
head): the queries of one or more sequences against their paged keys, both dots on FP8 tensor cores.

    fp8_prefill(q, k_pages, v_pages, block_table, cu_seqlens_q, seq_lens_k, scale, causal=True)
        -> (out [total_q, H, D] in q's dtype, lse [total_q, H] fp32, natural log)

q [total_q, H, D] (sequence b's queries at cu_seqlens_q[b]:cu_seqlens_q[b + 1]); k_pages, v_pages: Fp8Pages
([num_blocks, block_size, Hkv, D] uint8 and [num_blocks, block_size, Hkv] bf16 scales, any strides; K's and
the scales' last dimension contiguous);
block_table [B, max_blocks] int32; seq_lens_k [B] int32: sequence b's keys, its queries the last ones
(causal aligned to the end: query i of m sees keys 0 .. n - m + i).

The arithmetic (chosen by its error against fp64: with an outlier channel in K it keeps attention within 0.054
where FlashAttention-3's one scale per (block, KV head) gives 0.158; docs/research/2026-11-25-fp8-kv-cache.md):
- Q in e4m3 with its own scale per (token, head), amax / 448, computed in the kernel;
- scores = (q8 . k8) * q_scale[row] * k_scale[key]: the cache's per-token scales on the columns, exact;
- probabilities P against the tile's own row maximum (<= 1, the largest exactly 1; FlashAttention-3 takes
  the running maximum, which leaves a tile far below it in e4m3's subnormals: error growing with the
  context), times v_scale[key] / max(v_scale over the tile), times 2^8, cast to e4m3, then P8 . v8 scaled
  back to the running maximum: V's per-token scales, exact;
- the row sums in fp32 before any cast; merges and the output in fp32.
`pv="fp16"` (a launch option, for measuring): the second dot in fp16 instead, V's e4m3 values turned into
fp16 (exact) and P * 256 * v_scale / max rounded to fp16, not e4m3 (11 significant bits, not 4). FP8's MMA
takes both operands K-major, so an FP8 second dot has V's tile transposed in shared memory a byte at a time;
the fp16 one reads it as stored, at half FP8's rate for that dot. V's pages given transposed (a view with the
page's keys contiguous, e.g. stored [blocks, Hkv, D, page]) are read K-major by the FP8 dot itself: no
byte-wise transpose (scripts/hopper_codegen.py prefill-vt), the same values and result.
`q_split=True` (a launch option, for measuring): Q as two e4m3 parts, the second the first's rounding remainder
with its own scale per (token, head), and Q . K as two FP8 dots. With an outlier channel in K, Q's rounding is
most of this arithmetic's error (0.046 alone of 0.057 at 4K tokens); split, the whole is 0.036, for twice the
first dot's work.

One program per (query tile, query head, sequence), heavy tiles first; keys in tiles of BN (a page or part
of one): the tiles every query of the program sees without a mask, then the diagonal's, masked.
DOTS = "fp8" runs both dots on FP8 operands (CUDA, capability 8.9+); "fp16" turns the same rounded e4m3
values into fp16 first (exact: 4 significant bits) for the Triton interpreter, which multiplies FP8 bytes
as integers. Both compute the same products.

`fp8_prefill_reference` (torch): the kernel's arithmetic tile by tile, the same rounding of Q and P: equal
to the kernel's but for the order of the dots' sums; the path off CUDA and the tests' yardstick.
"""
import torch

from burstserve.kernels.arith import ceil_div
from burstserve.kernels.kv_quant import FP8, FP8_MAX, Fp8Pages
from burstserve.kernels.triton_setup import LazyTriton, e4m3_by_arithmetic

tl = None      # triton.language, bound by _build (the kernels resolve it as a global)
_tile = None   # the kernel's key-tile step (a jitted function), bound by _build
_fp8 = None    # a loaded tile as float8e4nv (jitted), bound by _build
_e4m3 = None   # the fp16 branch's e4m3 rounding (triton_setup.e4m3_by_arithmetic), bound by _build

P_OFFSET = 256.0          # FlashAttention-3's 2^8: P in e4m3 as P * 256 (448 >= 256: no overflow at P = 1)
MIN_Q_SCALE = 2.0 ** -126
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def fp8_prefill(q: torch.Tensor, k_pages: Fp8Pages, v_pages: Fp8Pages, block_table: torch.Tensor,
                cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, scale: float, causal: bool = True,
                max_seqlen_q: int | None = None, **launch) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring. max_seqlen_q: the longest sequence's queries (read from cu_seqlens_q on the
    host when None). launch: the Triton launch's settings (block_m, block_n, num_warps, num_stages, dots, pv,
    q_split)."""
    kern = _triton.kernels(q.device)
    if kern is not None:
        try:
            return _prefill_triton(kern["prefill"], q, k_pages, v_pages, block_table, cu_seqlens_q, seq_lens_k,
                                   scale, causal, max_seqlen_q, **launch)
        except Exception as e:      # compile or launch failure: the torch ops from now on
            _triton.failed(e)
    return fp8_prefill_reference(q, k_pages, v_pages, block_table, cu_seqlens_q, seq_lens_k, scale, causal,
                                 pv=launch.get("pv", "fp8"), q_split=launch.get("q_split", False))


# ---------------------------------------------------------------- torch (the reference, and off CUDA)

def fp8_prefill_reference(q, k_pages, v_pages, block_table, cu_seqlens_q, seq_lens_k, scale, causal=True,
                          block_n=128, pv="fp8", q_split=False):
    """The kernel's arithmetic in torch ops, tile by tile of block_n keys (its running maximum, its rounding
    of Q and P; pv: P rounded to e4m3 or to fp16, q_split: Q as two e4m3 parts, as the kernel's launch
    options) -> (out [total_q, H, D] in q's dtype, lse [total_q, H]): equal to the kernel's but for the order
    of the dots' fp32 sums."""
    total_q, h, d = q.shape
    bn = min(block_n, k_pages.shape[1])
    out = torch.zeros(total_q, h, d, dtype=q.dtype, device=q.device)
    lse = torch.full((total_q, h), float("-inf"), dtype=torch.float32, device=q.device)
    cu, lens = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    for b, n in enumerate(lens):
        q0, q1 = cu[b], cu[b + 1]
        if q1 == q0 or n == 0:
            continue
        out[q0:q1], lse[q0:q1] = _one_sequence(q[q0:q1], k_pages, v_pages, block_table[b], n, scale, causal, bn,
                                               torch.float16 if pv == "fp16" else FP8, q_split)
    return out, lse


def _one_sequence(q, k_pages, v_pages, table, n, scale, causal, bn, p_dtype, q_split):
    """q [m, H, D] against the sequence's n keys, P rounded to p_dtype -> (out [m, H, D], lse [m, H])."""
    m, h, _ = q.shape
    qpk = h // k_pages.shape[2]
    keys = ceil_div(n, bn) * bn                                           # whole tiles, as the kernel reads
    blocks = table[:ceil_div(keys, k_pages.shape[1])].long()
    k8, k_scale = _tiles(k_pages, blocks, keys, n, qpk)                   # [keys, H, D] e4m3 values, [keys, H]
    v8, v_scale = _tiles(v_pages, blocks, keys, n, qpk)
    q_scale, q8 = _e4m3_rows(q.float())                                                     # [m, H], [m, H, D]
    if q_split:                                                     # the remainder as a second e4m3 operand
        rest_scale, rest8 = _e4m3_rows(q.float() - q8 * q_scale[..., None])
    pos = torch.arange(n - m, n, device=q.device) if causal else torch.full((m,), n - 1, device=q.device)
    run_max = torch.full((h, m), float("-inf"), device=q.device)
    total = torch.zeros(h, m, device=q.device)
    acc = torch.zeros(h, m, q.shape[-1], device=q.device)
    for t0 in range(0, keys, bn):
        key = torch.arange(t0, t0 + bn, device=q.device)
        s = torch.einsum("mhd,nhd->hmn", q8, k8[t0:t0 + bn])
        if q_split:
            s = (s * q_scale.t()[..., None]
                 + torch.einsum("mhd,nhd->hmn", rest8, k8[t0:t0 + bn]) * rest_scale.t()[..., None])
            s = s * (scale * LOG2E) * k_scale[t0:t0 + bn].t()[:, None, :]
        else:
            s = s * (q_scale.t() * (scale * LOG2E))[..., None] * k_scale[t0:t0 + bn].t()[:, None, :]
        s = s.masked_fill((key[None, :] > pos[:, None]) | (key >= n)[None, :], float("-inf"))
        tile_max = s.amax(dim=-1)                                                                # [H, m]
        new_max = torch.maximum(run_max, tile_max)
        safe = torch.where(new_max == float("-inf"), 0.0, new_max)
        alpha = torch.exp2(run_max - safe)
        empty = tile_max == float("-inf")                                                       # no key here
        beta = torch.where(empty, 0.0, torch.exp2(tile_max - safe))
        p = torch.exp2(s - torch.where(empty, 0.0, tile_max)[..., None])                         # <= 1, max 1
        total = total * alpha + p.sum(dim=-1) * beta
        vs = v_scale[t0:t0 + bn].t()                                                             # [H, bn]
        top = vs.amax(dim=-1).clamp(min=1e-30)                                                   # [H]
        p8 = (p * (vs * (P_OFFSET / top[:, None]))[:, None, :]).to(p_dtype).float()
        pv = torch.einsum("hmn,nhd->hmd", p8, v8[t0:t0 + bn])
        acc = acc * alpha[..., None] + pv * ((top / P_OFFSET)[:, None] * beta)[..., None]
        run_max = new_max
    seen = total > 0
    o = torch.where(seen[..., None], acc / torch.where(seen, total, 1.0)[..., None], 0.0)
    lse = torch.where(seen, (run_max + torch.log2(torch.where(seen, total, 1.0))) * LN2, float("-inf"))
    return o.transpose(0, 1).to(q.dtype), lse.t()


def _e4m3_rows(x):
    """x [..., D] fp32 -> (scale [...], e4m3 values [..., D] as fp32): a scale amax / 448 per row."""
    s = (x.abs().amax(dim=-1) / FP8_MAX).clamp(min=MIN_Q_SCALE)
    return s, (x / s[..., None]).to(FP8).float()


def _tiles(pages: Fp8Pages, blocks, keys, n, qpk):
    """The first `keys` slots of these pages -> (e4m3 values [keys, H, D] fp32, scales [keys, H] fp32, 0
    past n) with each KV head repeated for its qpk query heads."""
    data = pages.data[blocks].flatten(0, 1)[:keys].view(FP8).float().repeat_interleave(qpk, dim=1)
    s = pages.scale[blocks].flatten(0, 1)[:keys].float().repeat_interleave(qpk, dim=1)
    s[n:] = 0.0
    return data, s


# ---------------------------------------------------------------- Triton

def _prefill_triton(kernel, q, k_pages, v_pages, block_table, cu_seqlens_q, seq_lens_k, scale, causal,
                    max_seqlen_q, block_m=128, block_n=128, num_warps=8, num_stages=2, dots="fp8", pv="fp8",
                    q_split=False):
    total_q, h, d = q.shape
    _, bs, hkv, _ = k_pages.shape
    if max_seqlen_q is None:
        max_seqlen_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_n = min(block_n, bs)
    assert bs % block_n == 0, (bs, block_n)
    out = torch.empty(total_q, h, d, dtype=q.dtype, device=q.device)
    lse = torch.empty(total_q, h, dtype=torch.float32, device=q.device)
    if total_q == 0:
        return out, lse
    kd, ks, vd, vs = k_pages.data, k_pages.scale, v_pages.data, v_pages.scale
    assert kd.stride(3) == 1 and ks.stride(2) == 1 and vs.stride(2) == 1
    if dots == "fp8":
        # typed FP8 pointers: the pipeliner then copies K's tiles into shared memory and the MMA reads them
        # there (from uint8 ones it takes each tile through registers to bit-cast it)
        kd, vd = kd.view(FP8), vd.view(FP8)
    batch = block_table.shape[0]
    tiles = ceil_div(max_seqlen_q, block_m)
    kernel[(h, tiles, batch)](
        q, kd, ks, vd, vs, block_table, cu_seqlens_q.to(torch.int32), seq_lens_k.to(torch.int32), out, lse,
        scale * 1.4426950408889634, q.stride(0), q.stride(1), kd.stride(0), kd.stride(1), kd.stride(2),
        ks.stride(0), ks.stride(1), vd.stride(0), vd.stride(1), vd.stride(2), vd.stride(3), vs.stride(0), vs.stride(1),
        block_table.stride(0), out.stride(0), out.stride(1), lse.stride(0), tiles,
        QPK=h // hkv, D=d, BS=bs, BM=block_m, BN=block_n, CAUSAL=causal, FP8_DOTS=dots == "fp8",
        PV16=pv == "fp16", Q_SPLIT=q_split, num_warps=num_warps, num_stages=num_stages)
    return out, lse


def _build() -> dict:
    """jit the prefill kernel. A fresh one each call: tests build an interpreted one (TRITON_INTERPRET=1)."""
    global tl
    import triton
    import triton.language as tl

    global _tile, _fp8, _e4m3

    _e4m3 = e4m3_by_arithmetic()

    def tile(acc, m, l, q8, q_scale, rest8, rest_scale, kd_ptr, ks_ptr, vd_ptr, vs_ptr, table_ptr, t, pos, n,
             k_tok, k_page, v_tok, v_dim, v_page, ks_tok, ks_page, vs_tok, vs_page, qk_scale,
             D: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr, FP8_DOTS: tl.constexpr,
             PV16: tl.constexpr, Q_SPLIT: tl.constexpr):
        """One key tile t (keys t * BN ...) absorbed into the running (acc [BM, D], m [BM], l [BM])."""
        tiles = BS // BN
        page = tl.load(table_ptr + t // tiles).to(tl.int64)
        slot = (t % tiles) * BN + tl.arange(0, BN)                                      # [BN] in the page
        key = t * BN + tl.arange(0, BN)
        cols = tl.arange(0, D)
        dt = tl.float8e4nv if FP8_DOTS else tl.float16
        k = _fp8(tl.load(kd_ptr + page * k_page + slot[:, None] * k_tok + cols[None, :]))
        k_scale = tl.load(ks_ptr + page * ks_page + slot * ks_tok).to(tl.float32)          # [BN]
        kt = tl.trans(k.to(dt))
        if Q_SPLIT:                                             # Q's rounding remainder: a second FP8 dot
            scores = tl.dot(q8, kt) * q_scale[:, None] + tl.dot(rest8, kt) * rest_scale[:, None]
            scores = scores * qk_scale * k_scale[None, :]                                # log2 units
        else:
            scores = tl.dot(q8, kt)                                                      # [BM, BN] fp32
            scores = scores * (q_scale * qk_scale)[:, None] * k_scale[None, :]           # log2 units
        if MASK:
            visible = (key[None, :] <= pos[:, None]) & (key[None, :] < n)
            scores = tl.where(visible, scores, float("-inf"))
        tile_max = tl.max(scores, axis=1)
        m_new = tl.maximum(m, tile_max)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)                            # a row with no key yet
        alpha = tl.exp2(m - m_safe)
        # P against this tile's own maximum (its largest exactly 1), so a tile far below the running maximum
        # keeps e4m3's normal range; beta carries it to the running maximum after the dot
        empty = tile_max == float("-inf")
        beta = tl.where(empty, 0.0, tl.exp2(tile_max - m_safe))
        p = tl.exp2(scores - tl.where(empty, 0.0, tile_max)[:, None])
        l = l * alpha + tl.sum(p, axis=1) * beta
        v = _fp8(tl.load(vd_ptr + page * v_page + slot[:, None] * v_tok + cols[None, :] * v_dim))
        v_scale = tl.load(vs_ptr + page * vs_page + slot * vs_tok).to(tl.float32)         # [BN]
        if MASK:
            v_scale = tl.where(key < n, v_scale, 0.0)                                     # the slots past n
        top = tl.maximum(tl.max(v_scale, axis=0), 1e-30)
        p8 = p * (v_scale * (256.0 / top))[None, :]                                      # P_OFFSET = 256
        if PV16:
            pv = tl.dot(p8.to(tl.float16), v.to(tl.float16))
        else:
            p8 = p8.to(tl.float8e4nv).to(dt) if FP8_DOTS else _e4m3(p8).to(dt)
            pv = tl.dot(p8, v.to(dt))
        acc = acc * alpha[:, None] + pv * ((top / 256.0) * beta)[:, None]
        return acc, m_new, l

    def fp8(x):
        """A loaded K/V tile as float8e4nv: as is from float8 pages (the GPU's), bit-cast from uint8 ones."""
        if x.dtype == tl.uint8:
            x = x.to(tl.float8e4nv, bitcast=True)
        return x

    _tile = triton.jit(tile)
    _fp8 = triton.jit(fp8)

    def prefill_kernel(q_ptr, kd_ptr, ks_ptr, vd_ptr, vs_ptr, table_ptr, cu_ptr, lens_ptr, out_ptr, lse_ptr,
                       qk_scale, q_tok, q_head, k_page, k_tok, k_head, ks_page, ks_tok, v_page, v_tok, v_head, v_dim,
                       vs_page, vs_tok, table_stride, o_tok, o_head, lse_tok, tiles_m,
                       QPK: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       CAUSAL: tl.constexpr, FP8_DOTS: tl.constexpr, PV16: tl.constexpr, Q_SPLIT: tl.constexpr):
        """Program (query head h, query tile, sequence b): out and lse of the tile's rows for head h."""
        h = tl.program_id(0)
        mt = tiles_m - 1 - tl.program_id(1)                                # the longest rows first
        b = tl.program_id(2)
        q0 = tl.load(cu_ptr + b)
        m_len = tl.load(cu_ptr + b + 1) - q0
        if mt * BM >= m_len:
            return
        n = tl.load(lens_ptr + b)
        g = h // QPK
        rows = mt * BM + tl.arange(0, BM)
        row_ok = rows < m_len
        cols = tl.arange(0, D)
        tok = (q0 + rows).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * q_tok + h * q_head + cols[None, :], mask=row_ok[:, None], other=0.0)
        q = q.to(tl.float32)
        q_scale = tl.maximum(tl.max(tl.abs(q), axis=1) / 448.0, 1.1754943508222875e-38)   # MIN_Q_SCALE
        dt = tl.float8e4nv if FP8_DOTS else tl.float16
        q8 = q / q_scale[:, None]
        q8 = q8.to(tl.float8e4nv).to(dt) if FP8_DOTS else _e4m3(q8).to(dt)
        rest8, rest_scale = q8, q_scale                                     # (unused without Q_SPLIT)
        if Q_SPLIT:                                                         # the remainder, rounded alike
            rest = q - q8.to(tl.float32) * q_scale[:, None]
            rest_scale = tl.maximum(tl.max(tl.abs(rest), axis=1) / 448.0, 1.1754943508222875e-38)
            rest8 = rest / rest_scale[:, None]
            rest8 = rest8.to(tl.float8e4nv).to(dt) if FP8_DOTS else _e4m3(rest8).to(dt)
        if CAUSAL:
            pos = n - m_len + rows                                          # the rows' positions among the keys
        else:
            pos = rows * 0 + n - 1                                          # every row sees every key
        m = tl.full([BM], float("-inf"), tl.float32)
        l = tl.zeros([BM], tl.float32)
        acc = tl.zeros([BM, D], tl.float32)
        table = table_ptr + b.to(tl.int64) * table_stride
        kd, vd = kd_ptr + g * k_head, vd_ptr + g * v_head
        ks, vs = ks_ptr + g, vs_ptr + g
        if CAUSAL:
            first_pos = n - m_len + mt * BM                                 # the tile's first row sees keys <= it
            free = tl.maximum(first_pos + 1, 0) // BN                       # tiles every row sees whole
            end = tl.minimum(n, first_pos + BM)
        else:
            free = n // BN
            end = n
        for t in range(0, free):
            acc, m, l = _tile(acc, m, l, q8, q_scale, rest8, rest_scale, kd, ks, vd, vs, table, t, pos, n, k_tok,
                             k_page, v_tok, v_dim, v_page, ks_tok, ks_page, vs_tok, vs_page, qk_scale, D, BS, BN,
                             False, FP8_DOTS, PV16, Q_SPLIT)
        for t in range(free, tl.cdiv(end, BN)):
            acc, m, l = _tile(acc, m, l, q8, q_scale, rest8, rest_scale, kd, ks, vd, vs, table, t, pos, n, k_tok,
                             k_page, v_tok, v_dim, v_page, ks_tok, ks_page, vs_tok, vs_page, qk_scale, D, BS, BN,
                             True, FP8_DOTS, PV16, Q_SPLIT)
        has = l > 0
        o = tl.where(has[:, None], acc / tl.where(has, l, 1.0)[:, None], 0.0)
        lse = tl.where(has, (m + tl.log2(tl.where(has, l, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(out_ptr + tok[:, None] * o_tok + h * o_head + cols[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(lse_ptr + tok * lse_tok + h, lse, mask=row_ok)

    # the tensors' strides are specialized (Triton notes which are multiples of 16): unspecialized, the K/V
    # tiles' rows have no known alignment and are loaded a byte at a time, without asynchronous copies
    return {"prefill": triton.jit(prefill_kernel, do_not_specialize=["table_stride", "lse_tok", "tiles_m"])}


_triton = LazyTriton(_build, "fp8-attention")
