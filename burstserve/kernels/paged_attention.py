"""Attention of new tokens against a paged KV cache: decode (one new token per sequence) and chunks.

    paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, causal=True,
                    backend="auto", num_chunks=None, max_seqlen_q=None, rows_see_keys=False)
        -> (out [total_q, H, D] in q's dtype, lse [total_q, H] fp32, natural log)

q [total_q, H, D]: the new tokens of B sequences packed, sequence b's rows cu_seqlens_q[b]:cu_seqlens_q[b+1].
k_cache, v_cache [num_blocks, block_size, Hkv, D] (H % Hkv == 0), or two kernels.kv_quant.Fp8Pages (an FP8
cache: on CUDA a decode call reads them in place, kernels.fp8_paged_attention, graphable; any other call
gathers and dequantizes each sequence's pages, FP8_GATHER_SEGMENT keys at a time at most, and attends them
with one flash-attn-4 call where it runs, else the dense backend, or with `gathered_attn` where the caller
gives one: --attention-backend fa3-fp8's FP8 kernel); block_table [B, max_blocks] int32;
seq_lens_k [B] int32: sequence b's keys are the first seq_lens_k[b] slots of its blocks, its new
tokens' keys included. `causal` is aligned to the end: query i of a sequence with q_len new tokens
sees keys 0 .. seq_lens_k - q_len + i. A query that sees no key gives out 0 and lse -inf.

rows_see_keys: the caller guarantees every query row sees at least one key (causal: seq_lens_k >= q_len
for every sequence; not causal: seq_lens_k > 0), so the flash-attn-4 path skips finding and zeroing rows
without keys (about 12 small kernels a call, which a small chunk's extend, bound by the host, pays per layer).

max_seqlen_q (flash-attn's name; optional, host-known): the largest q_len in the batch. With
max_seqlen_q == 1 and total_q == B every sequence has exactly one new token (decode), so
cu_seqlens_q must be arange(B + 1) (the caller guarantees it; it is not read again): the flash-attn-4
path then skips the per-row lookup and runs its fewest kernels. A sequence of a decode batch may
have seq_lens_k 0 (a padding slot of a CUDA-graph batch): out 0, lse -inf.

Backends, chosen by device:
- "reference": any device; gathers each sequence's blocks and calls kernels.attention.reference_attention.
- "dense": without flash-attn-4 (CUDA, or the CPU); gathers and calls the best dense backend (select_backend).
  Both gathered paths read lengths on the host (not capturable in a CUDA graph).
- "fa4": flash_attn.cute's varlen kernel reading the cache through `page_table` / `seqused_k`; no
  host synchronization, so a CUDA graph can capture it (fixed shapes). When there are too few query
  rows to fill the GPU (few long sequences: SM90 has no split-KV), each row's keys are split into
  chunks (widths from the row's own length, on the device) run as one batch with the query repeated,
  and the chunks are merged by LSE (a Triton kernel for the repeat + chunk lengths and tables and one
  for the merge where Triton works, else plain torch ops).
  flash-attn-4 reads whole pages: slots past seq_lens_k in a sequence's last page must be finite;
  it also reads the int32 before a keyless row's table row, so tables go through guarded_table.
  CUDA graphs: run each shape once eagerly before capturing it (flash-attn-4 and Triton compile on
  their first call; the split path's shape-only constants, e.g. the chunk starts and the one-token
  cu_seqlens, are cached per device and shape on their first eager call; made during a capture,
  they belong to that graph and are not cached).
"""
import functools
import logging
from dataclasses import dataclass

import torch

from burstserve.kernels.arith import ceil_div, next_pow2
from burstserve.kernels.device import num_sms
from burstserve.kernels.fp8_paged_attention import fp8_paged_decode
from burstserve.kernels.kv_quant import Fp8Pages
from burstserve.kernels.attention import (AttentionBackend, enable_fa4_compile_cache, fa4_forward, reference_attention,
                                          select_backend, windowed_attention)
from burstserve.kernels.merge import merge_into, merge_partials
from burstserve.kernels.triton_setup import LazyTriton

log = logging.getLogger(__name__)
tl = None   # triton.language, bound by _build (the prep kernel resolves it as a global)

MIN_CHUNK_KEYS = 512      # a split chunk covers at least this many keys (fewer: launch-bound)
FP8_GATHER_SEGMENT = 131072  # FP8 pages gathered for a chunk this many keys at a time (sizing.fp8_gather_bytes)
MAX_CHUNKS = 64


def paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale: float,
                    causal: bool = True, backend: str = "auto", num_chunks: int | None = None,
                    max_seqlen_q: int | None = None, rows_see_keys: bool = False,
                    host_sizes: tuple[list[int], list[int]] | None = None,
                    gathered_attn: AttentionBackend | None = None, window: int | None = None):
    """See the module docstring. backend: auto | fa4 | dense | reference; num_chunks (fa4 only):
    None chooses from the shapes, 1 never splits; max_seqlen_q: the batch's largest q_len or None
    (1 with one row per sequence: the decode fast path; cu_seqlens_q must then be arange(B + 1));
    host_sizes: cu_seqlens_q and seq_lens_k as lists, where the caller has them (the gathered path then
    does not read them back from the device, a wait for the queued work, every layer); gathered_attn (backend
    auto, FP8 pages, not a decode call): the attention the gathered keys go through, causal end-aligned."""
    if window is not None:        # a sliding-window layer: each sequence's last keys gathered (windowed_attention)
        return _gathered(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, True, None, max_seqlen_q,
                         host_sizes, window)
    fp8 = isinstance(k_cache, Fp8Pages)
    if fp8 and q.is_cuda and backend == "auto" and max_seqlen_q == 1 and q.shape[0] == block_table.shape[0]:
        return fp8_paged_decode(q, k_cache, v_cache, block_table, seq_lens_k, scale)     # decode: in place
    if backend == "auto":
        if fp8 and (gathered_attn is not None or fa4_available(q.device)):   # a chunk over FP8 pages: gathered
            return _gathered(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, causal,
                             gathered_attn or FA4_END_ALIGNED, max_seqlen_q, host_sizes)
        backend = "fa4" if fa4_available(q.device) else "dense"
    if backend == "fa4":
        if fp8:
            raise ValueError("flash-attn-4 does not read FP8 pages; use the dense or reference backend")
        return _fa4(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, causal, num_chunks,
                    max_seqlen_q, rows_see_keys)
    if backend == "dense":
        attn = _dense_backend(q.device, q.dtype, q.shape[1], k_cache.shape[2], q.shape[2])
    elif backend == "reference":
        attn = AttentionBackend("reference", reference_attention)
    else:
        raise ValueError(f"unknown paged attention backend {backend!r}")
    return _gathered(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, causal, attn,
                     max_seqlen_q, host_sizes)


# ---------------------------------------------------------------- gathered (reference, dense fallback)

def _fa4_end_aligned(q, k, v, causal, scale):
    """q [m, H, D] against k, v [n, Hkv, D] (n >= m when causal) in one flash-attn-4 call, whose causal mask
    is aligned to the end (query i sees keys 0 .. n - m + i), as the paged calls' -> (out, lse [m, H])."""
    out, lse = fa4_forward(q[None], k[None], v[None], softmax_scale=scale, causal=causal)   # [1, m, H, D], [1, H, m]
    return out[0], lse[0].transpose(0, 1)


# the gathered path's attention over FP8 pages with flash-attn-4: its causal is already end-aligned
FA4_END_ALIGNED = AttentionBackend("fa4-end-aligned", _fa4_end_aligned)


def _gathered(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, causal, attn, max_seqlen_q=None,
              host_sizes=None, window=None):
    total_q, h, d = q.shape
    cu, lens = host_sizes or (cu_seqlens_q.tolist(), seq_lens_k.tolist())
    if max_seqlen_q is not None and any(b - a > max_seqlen_q for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"a sequence has more than max_seqlen_q={max_seqlen_q} new tokens: cu_seqlens_q {cu}")
    parts = [(cu[b], cu[b + 1], *_sequence(q[cu[b]:cu[b + 1]], k_cache, v_cache, block_table[b], n, causal, scale,
                                           attn, window))
             for b, n in enumerate(lens) if cu[b + 1] > cu[b] and n > 0]
    if len(parts) == 1 and parts[0][:2] == (0, total_q):          # one sequence, every row (a chunk): as it is
        return parts[0][2], parts[0][3]
    out = torch.zeros(total_q, h, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((total_q, h), float("-inf"), dtype=torch.float32, device=q.device)
    for q0, q1, o, s in parts:
        out[q0:q1], lse[q0:q1] = o, s
    return out, lse


def _sequence(q, k_cache, v_cache, table_row, n, causal, scale, attn, window=None):
    """One sequence's queries q [m, H, D] against the first n keys of its pages (table_row [max_blocks]); with a
    window, the last m + window - 1 of them, the queries being the last m positions (windowed_attention)."""
    bs = k_cache.shape[1]
    blocks = table_row[:(n + bs - 1) // bs].long()
    if window is not None:
        lo = max(0, n - q.shape[0] - window + 1)
        k, v = _gather(k_cache, blocks, n, q.dtype)[lo:], _gather(v_cache, blocks, n, q.dtype)[lo:]
        return windowed_attention(q, k, v, scale, window)
    if isinstance(k_cache, Fp8Pages) and n - (q.shape[0] if causal else 0) > FP8_GATHER_SEGMENT:
        return _fp8_segments(q, k_cache, v_cache, blocks, n, causal, scale, attn)
    k = _gather(k_cache, blocks, n, q.dtype)             # [n, Hkv, D]
    v = _gather(v_cache, blocks, n, q.dtype)
    if attn is FA4_END_ALIGNED and n >= q.shape[0]:
        return attn(q, k, v, causal, scale)
    return _end_aligned(q, k, v, causal, scale, attn)


def _fp8_segments(q, k_pages, v_pages, blocks, n, causal, scale, attn):
    """q [m, H, D] against n keys in FP8 pages, gathered and dequantized FP8_GATHER_SEGMENT keys at a time
    (a 1M-token context is 4 GiB a layer in bf16): the keys every query sees, segment by segment without a
    mask, then the last m keys causally (or the rest without a mask), each partial merged by LSE into one
    fp32 accumulator as it comes (not held until the end: a 1M context's eight partials of a 64K chunk are
    4 GiB in bf16; an accumulator in q's dtype would be rounded at every merge)."""
    m = q.shape[0]
    seen = n - m if causal else n                             # keys every query sees (> 0 here)
    bounds = list(range(0, seen, FP8_GATHER_SEGMENT)) + [seen]
    pieces = [(a, b, False) for a, b in zip(bounds[:-1], bounds[1:])] + ([(seen, n, True)] if causal else [])
    out = torch.zeros(m, q.shape[1], v_pages.shape[-1], dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
    for start, stop, masked in pieces:                        # the last one causal: a square m x m
        k, v = k_pages.gather_range(blocks, start, stop, q.dtype), v_pages.gather_range(blocks, start, stop, q.dtype)
        merge_into(out, lse, *attn(q, k, v, masked, scale))
        del k, v
    return out.to(q.dtype), lse


def _gather(cache, blocks, n, dtype):
    """The first n slots of these blocks [b] of a cache (a tensor or Fp8Pages) -> [n, Hkv, D]."""
    if isinstance(cache, Fp8Pages):
        return cache.gather(blocks, n, dtype)
    return cache[blocks].flatten(0, 1)[:n]


def _end_aligned(q, k, v, causal, scale, attn):
    """q [m, H, D] against k, v [n, Hkv, D]; causal aligned to the end (query i sees keys 0..n-m+i).
    attn's own causal is top-left on a square block, so: the keys before the new tokens (seen by
    every query) without a mask, the square block of the new tokens' keys causal, merged by LSE."""
    m, n = q.shape[0], k.shape[0]
    if not causal:
        return attn(q, k, v, False, scale)
    off = n - m
    if off < 0:                     # fewer keys than queries: the first -off queries see nothing
        out = torch.zeros(m, q.shape[1], v.shape[-1], dtype=q.dtype, device=q.device)
        lse = torch.full((m, q.shape[1]), float("-inf"), dtype=torch.float32, device=q.device)
        out[-off:], lse[-off:] = attn(q[-off:], k, v, True, scale)      # square n x n
        return out, lse
    diag = attn(q, k[off:], v[off:], True, scale)                      # square m x m
    if off == 0:
        return diag
    prefix = attn(q, k[:off], v[:off], False, scale)                   # [m, off]: no mask
    return merge_partials(torch.stack([prefix[0], diag[0]]), torch.stack([prefix[1], diag[1]]), q.dtype)


@functools.lru_cache(maxsize=None)
def _dense_backend(device, dtype, h, hkv, d) -> AttentionBackend:
    return select_backend(device, dtype, h, hkv, d)


# ---------------------------------------------------------------- flash-attn-4 (page_table)

@functools.lru_cache(maxsize=None)
def fa4_available(device: torch.device) -> bool:
    """flash_attn.cute imports and the device is SM90 or newer."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    enable_fa4_compile_cache()
    try:
        import flash_attn.cute  # noqa: F401
        return True
    except Exception as e:   # ImportError, or a broken CuTe-DSL install
        log.info("flash-attn-4 unavailable for paged attention: %s", e)
        return False


def _row_visible_keys(cu_seqlens_q, seq_lens_k, total_q, causal):
    """Per query row: its sequence [R] and how many keys it sees [R] (device ops only)."""
    rows = torch.arange(total_q, device=cu_seqlens_q.device, dtype=cu_seqlens_q.dtype)
    seq = torch.searchsorted(cu_seqlens_q[1:].contiguous(), rows, right=True)          # [R]
    n = seq_lens_k.long()[seq]
    if not causal:
        return seq, n
    q_len = (cu_seqlens_q[seq + 1] - cu_seqlens_q[seq]).long()
    i = (rows - cu_seqlens_q[seq]).long()
    return seq, (n - q_len + i + 1).clamp(min=0)


def choose_num_chunks(rows: int, num_kv_heads: int, max_keys: int, num_sms: int) -> int:
    """Chunks per query row so that rows x kv heads x chunks about fills the SMs (the kernel runs
    one CTA per (row, kv head) in decode: packed GQA), each chunk at least MIN_CHUNK_KEYS keys.
    max_keys is the block table's capacity (host-known, so the choice holds under CUDA graphs)."""
    by_sms = num_sms // max(rows * num_kv_heads, 1)
    by_keys = max_keys // MIN_CHUNK_KEYS
    return max(1, min(by_sms, by_keys, MAX_CHUNKS))


def _fa4_call(q, k_cache, v_cache, page_table, cu_seqlens_q, seqused_k, scale, causal, max_seqlen_q):
    page_table = guarded_table(page_table)
    out, lse = fa4_forward(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k, page_table=page_table,
                           max_seqlen_q=max_seqlen_q, softmax_scale=scale, causal=causal)
    return out, lse.transpose(0, 1)                    # lse [H, total_q] -> [total_q, H]


def guarded_table(table: torch.Tensor) -> torch.Tensor:
    """table [B, P] int32 -> the same values in memory with one readable int32 before them.

    flash-attn-4 4.0.0b36 (SM90, TMA paged path: page size == its key tile) reads page_table[b, -1]
    for a row b with no keys (n_block_max - 1 = -1; the loaded tile is all out of bounds, so the
    value does not matter); for row 0 that is the int32 before the table: outside any allocation
    when the table starts a memory segment, an illegal memory access (the decode graphs' warm-up hits
    it: every row of a padding batch has no keys). A table that is
    a view with an offset into its storage is returned as it is (callers that run many layers build
    it so once: engine.model_runner); else it is copied after one zero entry (1 kernel)."""
    if table.storage_offset() > 0 and table.is_contiguous():
        return table
    buf = torch.empty(table.numel() + 1, dtype=table.dtype, device=table.device)
    buf[:1].zero_()
    out = buf[1:].view(table.shape)
    out.copy_(table)
    return out


def _fa4(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, causal, num_chunks,
         max_seqlen_q=None, rows_see_keys=False):
    total_q = q.shape[0]
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    b, max_blocks = block_table.shape
    seq_lens_k = seq_lens_k.to(torch.int32)                                          # no-op when int32
    if num_chunks is None:
        num_chunks = choose_num_chunks(total_q, hkv, max_blocks * bs, num_sms(q.device))
    if max_seqlen_q == 1 and total_q == b:
        # Decode: row r is sequence r and sees all its seq_lens_k[r] keys (causal or not).
        if num_chunks > 1:
            return _fa4_split(q, k_cache, v_cache, block_table, seq_lens_k, scale, num_chunks)
        out, lse = _fa4_call(q, k_cache, v_cache, block_table, cu_seqlens_q.to(torch.int32), seq_lens_k,
                             scale, False, 1)
        return _zero_empty_rows(out, lse, seq_lens_k)
    cu_seqlens_q = cu_seqlens_q.to(torch.int32)
    if num_chunks == 1 and rows_see_keys:                                            # nothing to zero
        return _fa4_call(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, causal, max_seqlen_q)
    seq, visible = _row_visible_keys(cu_seqlens_q, seq_lens_k, total_q, causal)     # [R], [R]
    if num_chunks > 1:   # the split's merge already gives rows without keys 0 / -inf
        return _fa4_split(q, k_cache, v_cache, block_table.index_select(0, seq), visible.to(torch.int32),
                          scale, num_chunks)
    out, lse = _fa4_call(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, causal,
                         max_seqlen_q)
    return _zero_empty_rows(out, lse, visible)


def _zero_empty_rows(out, lse, visible):
    """out 0 / lse -inf where visible [R] == 0, whatever the kernel wrote there (3 kernels)."""
    has = (visible > 0)[:, None]                                                     # [R, 1]
    return torch.where(has[..., None], out, 0.0), torch.where(has, lse, float("-inf"))


def _fa4_split(q, k_cache, v_cache, table, visible, scale, c):
    """Every query row r becomes c one-token "sequences": row r's visible[r] keys fill
    pages_r = ceil(visible[r] / bs) pages, cut into c chunks of p_r = ceil(pages_r / c) pages, chunk j
    holding pages [j*p_r, (j+1)*p_r) of its row's table and min(p_r*bs, visible[r] - j*p_r*bs) of their
    slots (0: an empty chunk). The widths are computed on the device from the lengths, so a CUDA graph
    captured for the table's full capacity still splits each row's actual keys c ways. Run as one
    batch without a mask (a one-token query sees all its visible keys), merged by LSE with empty
    chunks weighing 0 (whatever the kernel wrote for them): a row with no keys gives out 0, lse -inf.
    table [R, max_blocks] int32 (row r's sequence's block table), visible [R] int32.
    GPU kernels: chunk lengths + chunk tables + q repeat (Triton: 1; torch: ~22), flash-attn-4,
    merge (Triton: 1; torch: 15)."""
    r = q.shape[0]
    cu = _cached(q.device, ("arange_i32", r * c + 1),
                 lambda: torch.arange(r * c + 1, device=q.device, dtype=torch.int32))
    q_rep, used, chunk_table = _split_inputs(q, visible, table, c, k_cache.shape[1])   # [R*c, H, D], [R*c], [R*c, P]
    out, lse = _fa4_call(q_rep, k_cache, v_cache, chunk_table, cu, used, scale, False, 1)   # [R*c, H, D], [R*c, H]
    return _split_merge(out, lse, used, r, c, q.dtype)


# ---------------------------------------------------------------- a small chunk against a long cached prefix

MIN_RUN_KEYS = 32768     # a run of the cached prefix covers at least this many keys (below: host time > gain)
MAX_RUNS = 8
WAVE_SLACK = 0.05        # runs_filling_waves: a run more only for 5 points more of the SMs' waves busy


@dataclass
class PrefixRuns:
    """One sequence's cached keys cut into runs of whole pages, the same for every layer of a chunk (so
    built once per chunk, on the host): run j is pages [j*p, (j+1)*p) of the sequence, `used[j]` of their
    slots; the chunk's `rows` queries are repeated once per run (cu = 0, rows, 2 rows, ...)."""
    table: torch.Tensor     # [c, p] int32, guarded_table layout
    used: torch.Tensor      # [c] int32, every entry > 0
    cu: torch.Tensor        # [c + 1] int32
    rows: int


def prefix_run_count(rows: int, q_per_kv: int, num_kv_heads: int, cached: int, num_sms: int) -> int:
    """Runs for a chunk of `rows` queries against `cached` keys: enough to fill the SMs (the kernel runs one
    CTA per 128 packed query rows per kv head: 256 new tokens of llama3-8b make 64 CTAs on 132 SMs, over
    half of them idle, and split 2 ways the same call takes little more than half the time:
    docs/benchmarks.md, Kernels), each at least MIN_RUN_KEYS."""
    limit = max(1, min(cached // MIN_RUN_KEYS, MAX_RUNS))
    return runs_filling_waves(attention_ctas(rows, q_per_kv, num_kv_heads), num_sms, limit)


def attention_ctas(rows: int, q_per_kv: int, num_kv_heads: int) -> int:
    """CTAs of flash-attn-4's forward for `rows` queries of one sequence: one per 128 packed query rows
    (the q_per_kv query heads of a KV head packed) per KV head."""
    return ceil_div(rows * q_per_kv, 128) * num_kv_heads


def runs_filling_waves(ctas: int, num_sms: int, limit: int) -> int:
    """The runs r (1..limit) whose ctas x r CTAs keep the SMs busiest over whole waves: a grid that is not
    a multiple of the SMs leaves its last wave partly idle (llama3-8b on 132 SMs: 384 new tokens make 96
    CTAs, 73% of one wave, 4 runs 384 CTAs, 97% of 3; 640 tokens 160 CTAs, 61% of 2 waves, 4 runs 97%).
    The fewest runs within WAVE_SLACK of the best: each run adds a partial to merge. Filling whole waves,
    not just one, is what makes mid-sized chunks cheaper (docs/benchmarks.md, Kernels)."""
    def busy(r: int) -> float:
        grid = ctas * r
        return grid / (ceil_div(grid, num_sms) * num_sms)
    candidates = range(1, max(limit, 1) + 1)
    best = max(busy(r) for r in candidates)
    return next(r for r in candidates if busy(r) >= best - WAVE_SLACK)


def prefix_runs(pages: list[int], cached: int, block_size: int, rows: int, runs: int,
                device: torch.device) -> PrefixRuns:
    """pages: the sequence's pages in token order (at least ceil(cached / block_size)); cached > 0."""
    n_pages = ceil_div(cached, block_size)
    per = ceil_div(n_pages, runs)                                   # pages per run
    count = ceil_div(n_pages, per)                                  # no empty run
    table = torch.zeros(count, per, dtype=torch.int32)
    for j in range(count):
        run = pages[j * per:min((j + 1) * per, n_pages)]
        table[j, :len(run)] = torch.tensor(run, dtype=torch.int32)
    used = [min(per * block_size, cached - j * per * block_size) for j in range(count)]
    return PrefixRuns(guarded_table(table.to(device)), torch.tensor(used, dtype=torch.int32, device=device),
                      torch.arange(0, (count + 1) * rows, rows, dtype=torch.int32, device=device), rows)


def device_prefix_runs(table_row: torch.Tensor, cached: torch.Tensor, runs: int, block_size: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """prefix_runs built on the device, for a CUDA graph: table_row [1, P] int32 (a sequence's pages in
    token order), cached [1] int32 (its keys before the new tokens, read only on the device) -> (table
    [runs, ceil(P / runs)] int32 in the guarded_table layout, used [runs] int32): run j is pages
    [j*p, (j+1)*p) with p = ceil(ceil(cached / block_size) / runs), used[j] of their slots, 0 for a run
    past the keys (and all runs when cached is 0). The split path's prep (one Triton kernel on CUDA)."""
    anchor = table_row.new_empty((1, 1, 1))                       # one row: the prep never copies a query
    _, used, table = _split_inputs(anchor, cached, table_row, runs, block_size)
    return table, used


def split_prefix_attention(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, runs: PrefixRuns, scale: float, backend
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's queries q [m, H, D] against its sequence's cached keys (flash-attn-4, one call over the
    runs, no mask) and, unless k is None, causally against its own k, v [m, Hkv, D] (backend: an
    AttentionBackend), the partials merged by LSE in fp32 (merge_partials: one Triton kernel) -> (out
    [m, H, D] in q's dtype, lse [m, H] fp32). 3 kernel calls (2 without k) and ~4 small kernels."""
    c, (m, h, _) = runs.used.shape[0], q.shape
    out, lse = _fa4_call(q.repeat(c, 1, 1), k_cache, v_cache, runs.table, runs.cu, runs.used, scale, False, m)
    outs, lses = out.view(c, m, h, -1), lse.reshape(c, m, h)                         # [c, m, H, D], [c, m, H]
    if k is not None:
        new_out, new_lse = backend(q, k, v, True, scale)
        outs, lses = torch.cat([outs, new_out[None]]), torch.cat([lses, new_lse[None]])   # [c + 1, ...]
    return merge_partials(outs, lses, q.dtype)


# ---------------------------------------------------------------- split helpers (Triton or torch)

_CONSTS: dict = {}


def _cached(device, key, make):
    """A shape-only constant tensor, made once per (device, key). One made while the current CUDA
    stream is capturing is returned uncached (it belongs to that graph: its values exist only on
    replay), so warm up eagerly before capture to get the cached one into the graph."""
    t = _CONSTS.get((device, key))
    if t is None:
        t = make()
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _CONSTS[(device, key)] = t
    return t


def _split_inputs(q, visible, table, c, bs):
    """q [R, H, D], visible [R] int32, table [R, max_blocks] int32, page size bs ->
    q_rep [R*c, H, D] (row r*c+j = q[r]), used [R*c] int32 (chunk j of row r: its keys, see
    _fa4_split), chunk_table [R*c, P] int32 with P = ceil(max_blocks / c) (row r*c+j: pages
    j*p_r .. of row r, 0 past the table's end) in a guarded_table layout."""
    kern = _triton.kernels(q.device)
    if kern is not None:
        try:
            return _split_inputs_triton(kern["prep"], q, visible, table, c, bs)
        except Exception as e:  # compile or launch failure: torch from now on
            _triton.failed(e)
    r, max_blocks = table.shape
    width = ceil_div(max_blocks, c)                                                     # P
    n = visible.long()[:, None]                                                     # [R, 1]
    per_chunk = (n + bs - 1).div(bs, rounding_mode="floor").add(c - 1).div(c, rounding_mode="floor")  # p_r [R, 1]
    j = _cached(q.device, ("chunk_index", c), lambda: torch.arange(c, device=q.device))             # [c]
    used = (n - j * per_chunk * bs).clamp(min=0).minimum(per_chunk * bs).to(torch.int32).view(-1)   # [R*c]
    t = _cached(q.device, ("page_index", width), lambda: torch.arange(width, device=q.device))      # [P]
    src = (j[:, None] * per_chunk[:, :, None] + t).view(r, c * width)                 # [R, c*P] int64
    pages = table.long().gather(1, src.clamp(max=max_blocks - 1)).masked_fill_(src >= max_blocks, 0)
    return _repeat_rows(q, c), used, guarded_table(pages.to(torch.int32).view(r * c, width))


def _repeat_rows(q, c):
    """q [R, H, D] -> [R*c, H, D], row r*c+j = q[r]. One row: a stride-0 view, no copy (flash-attn-4
    4.0.0b36 compiles a kernel for the broadcast q; tests/gpu's one-long split cases ran on it since
    the first version of this path). Several rows: no single strided view exists, a copy."""
    r, h, d = q.shape
    if r == 1:
        return q.expand(c, h, d)
    return q[:, None].expand(r, c, h, d).reshape(r * c, h, d)


def _split_merge(out, lse, used, r, c, dtype):
    """The kernel's per-chunk out [R*c, H, D], lse [R*c, H] (any strides) -> out [R, H, D] in dtype,
    lse [R, H] fp32, chunks with used [R*c] == 0 weighing 0 whatever out/lse hold there: merge_partials
    over [c, R, ...] views (no copy)."""
    h, d = out.shape[1], out.shape[2]
    return merge_partials(out.view(r, c, h, d).transpose(0, 1), lse.view(r, c, h).transpose(0, 1), dtype,
                          used.view(r, c).t())


def _build() -> dict:
    """jit the split's prep kernel: chunk lengths, chunk tables and q repeated in one kernel, where the torch
    ops take ~22 (docs/benchmarks.md, Kernels); the split's merge is kernels/merge.py's. A fresh one each
    call: tests build an interpreted one with TRITON_INTERPRET=1."""
    global tl
    import triton
    import triton.language as tl

    def _prep_kernel(q_ptr, visible_ptr, table_ptr, table_stride, max_blocks, q_rep_ptr, used_ptr, chunk_table_ptr,
                     c, bs, width, HD: tl.constexpr, HD_PAD: tl.constexpr, W_PAD: tl.constexpr, COPY_Q: tl.constexpr):
        """Program i = r*c + j (see _split_inputs): used[i], chunk_table[i, :width] = table[r, j*p_r + t]
        (0 past max_blocks), q_rep[i] = q[r]. chunk_table_ptr points at the guard entry (program 0 zeroes
        it); the table follows it."""
        i = tl.program_id(0)
        row = i // c
        j = i - row * c
        n = tl.load(visible_ptr + row)
        per_chunk = ((n + bs - 1) // bs + c - 1) // c
        u = tl.minimum(tl.maximum(n - j * per_chunk * bs, 0), per_chunk * bs)
        tl.store(used_ptr + i, u)
        t = tl.arange(0, W_PAD)
        src = j * per_chunk + t
        page = tl.load(table_ptr + row.to(tl.int64) * table_stride + src, mask=(t < width) & (src < max_blocks), other=0)
        tl.store(chunk_table_ptr + 1 + i.to(tl.int64) * width + t, page, mask=t < width)
        if i == 0:
            tl.store(chunk_table_ptr, 0)
        if COPY_Q:
            offs = tl.arange(0, HD_PAD)
            mask = offs < HD
            x = tl.load(q_ptr + row.to(tl.int64) * HD + offs, mask=mask)
            tl.store(q_rep_ptr + i.to(tl.int64) * HD + offs, x, mask=mask)

    # integer arguments unspecialized (no recompile per value of c, strides, ...): one compile per
    # constexpr combination and pointer alignment
    return {"prep": triton.jit(_prep_kernel, do_not_specialize=["table_stride", "max_blocks", "c", "bs", "width"])}


_triton = LazyTriton(_build, "split-attention")


def _split_inputs_triton(prep, q, visible, table, c, bs):
    r, h, d = q.shape
    max_blocks = table.shape[1]
    width = ceil_div(max_blocks, c)
    visible = visible.contiguous()
    if table.stride(1) != 1:
        table = table.contiguous()
    used = torch.empty(r * c, dtype=torch.int32, device=q.device)
    buf = torch.empty(1 + r * c * width, dtype=torch.int32, device=q.device)      # guard entry + chunk tables
    chunk_table = buf[1:].view(r * c, width)
    if r == 1:                                   # the stride-0 view (see _repeat_rows): no copy of q
        prep[(c,)](q, visible, table, table.stride(0), max_blocks, q, used, buf, c, bs, width,
                   HD=1, HD_PAD=1, W_PAD=next_pow2(width), COPY_Q=False)
        return _repeat_rows(q, c), used, chunk_table
    q = q.contiguous()
    q_rep = torch.empty(r * c, h, d, dtype=q.dtype, device=q.device)
    prep[(r * c,)](q, visible, table, table.stride(0), max_blocks, q_rep, used, buf, c, bs, width,
                   HD=h * d, HD_PAD=next_pow2(h * d), W_PAD=next_pow2(width), COPY_Q=True)
    return q_rep, used, chunk_table
