"""Attention of new tokens against a paged KV cache: decode (one new token per sequence) and chunks.

    paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, causal=True)
        -> (out [total_q, H, D] in q's dtype, lse [total_q, H] fp32, natural log)

q [total_q, H, D]: the new tokens of B sequences packed, sequence b's rows cu_seqlens_q[b]:cu_seqlens_q[b+1].
k_cache, v_cache [num_blocks, block_size, Hkv, D] (H % Hkv == 0); block_table [B, max_blocks] int32;
seq_lens_k [B] int32: sequence b's keys are the first seq_lens_k[b] slots of its blocks, its new
tokens' keys included. `causal` is aligned to the end: query i of a sequence with q_len new tokens
sees keys 0 .. seq_lens_k - q_len + i. A query that sees no key gives out 0 and lse -inf.

Backends, chosen by device:
- "reference": any device; gathers each sequence's blocks and calls kernels.attention.reference_attention.
- "dense": CUDA without flash-attn-4; gathers and calls the best dense backend (select_backend).
  Both gathered paths read lengths on the host (not capturable in a CUDA graph).
- "fa4": flash_attn.cute's varlen kernel reading the cache through `page_table` / `seqused_k`; no
  host synchronization, so a CUDA graph can capture it (fixed shapes). When there are too few query
  rows to fill the GPU (few long sequences: SM90 has no split-KV), each row's pages are split into
  chunks run as one batch with the query repeated, and the chunks are merged by LSE.
  flash-attn-4 reads whole pages: slots past seq_lens_k in a sequence's last page must be finite.
"""
import functools
import logging

import torch

from kernels.attention import AttentionBackend, enable_fa4_compile_cache, reference_attention, select_backend
from kernels.merge import merge_stacked

log = logging.getLogger(__name__)

MIN_CHUNK_KEYS = 512      # a split chunk covers at least this many keys (fewer: launch-bound)
MAX_CHUNKS = 64


def paged_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale: float,
                    causal: bool = True, backend: str = "auto", num_chunks: int | None = None):
    """See the module docstring. backend: auto | fa4 | dense | reference; num_chunks (fa4 only):
    None chooses from the shapes, 1 never splits."""
    if backend == "auto":
        backend = "reference" if q.device.type != "cuda" else ("fa4" if fa4_available(q.device) else "dense")
    if backend == "fa4":
        return _fa4(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, causal, num_chunks)
    if backend == "dense":
        attn = _dense_backend(q.device, q.dtype, q.shape[1], k_cache.shape[2], q.shape[2])
    elif backend == "reference":
        attn = AttentionBackend("reference", reference_attention)
    else:
        raise ValueError(f"unknown paged attention backend {backend!r}")
    return _gathered(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, causal, attn)


# ---------------------------------------------------------------- gathered (reference, dense fallback)

def _gathered(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, causal, attn):
    total_q, h, d = q.shape
    bs = k_cache.shape[1]
    out = torch.zeros(total_q, h, v_cache.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.full((total_q, h), float("-inf"), dtype=torch.float32, device=q.device)
    cu, lens = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    for b, n in enumerate(lens):
        q0, q1 = cu[b], cu[b + 1]
        if q1 == q0 or n == 0:
            continue
        blocks = block_table[b, :(n + bs - 1) // bs].long()
        k = k_cache[blocks].flatten(0, 1)[:n]                 # [n, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:n]
        out[q0:q1], lse[q0:q1] = _end_aligned(q[q0:q1], k, v, causal, scale, attn)
    return out, lse


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
    o, l = merge_stacked(torch.stack([prefix[0], diag[0]]), torch.stack([prefix[1], diag[1]]))
    return o.to(q.dtype), l


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
    from flash_attn.cute import flash_attn_varlen_func
    out, lse = flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q=cu_seqlens_q, seqused_k=seqused_k,
                                      page_table=page_table, max_seqlen_q=max_seqlen_q,
                                      softmax_scale=scale, causal=causal, return_lse=True)
    return out, lse.transpose(0, 1)                    # lse [H, total_q] -> [total_q, H]


def _fa4(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, causal, num_chunks):
    total_q, h, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    b, max_blocks = block_table.shape
    cu_seqlens_q = cu_seqlens_q.to(torch.int32)
    seq_lens_k = seq_lens_k.to(torch.int32)
    seq, visible = _row_visible_keys(cu_seqlens_q, seq_lens_k, total_q, causal)     # [R], [R]
    if num_chunks is None:
        num_sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        num_chunks = choose_num_chunks(total_q, hkv, max_blocks * bs, num_sms)
    if num_chunks <= 1:
        out, lse = _fa4_call(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale, causal, None)
    else:
        out, lse = _fa4_split(q, k_cache, v_cache, block_table, seq, visible, scale, num_chunks)
    empty = (visible == 0)[:, None]                                                   # [R, 1]
    return (torch.where(empty[..., None], torch.zeros_like(out), out),
            torch.where(empty, torch.full_like(lse, float("-inf")), lse))


def _fa4_split(q, k_cache, v_cache, block_table, seq, visible, scale, c):
    """Every query row r becomes c one-token "sequences", chunk j holding pages [j*p, (j+1)*p) of its
    sequence and min(p*bs, visible[r] - j*p*bs) of their slots (0: an empty chunk); run as one batch
    without a mask (a one-token query sees all its visible keys), merged by LSE."""
    r, h, d = q.shape
    bs = k_cache.shape[1]
    max_blocks = block_table.shape[1]
    p = -(-max_blocks // c)                                                # pages per chunk
    table = block_table.index_select(0, seq)                               # [R, max_blocks]
    if p * c > max_blocks:                                                 # pad: pages past the end are never read
        table = torch.nn.functional.pad(table, (0, p * c - max_blocks))
    table = table.view(r * c, p)                                           # [R*c, p] int32
    starts = torch.arange(c, device=q.device) * (p * bs)                   # [c]
    used = (visible[:, None] - starts[None, :]).clamp(0, p * bs).to(torch.int32).view(r * c)  # [R*c]
    q_rep = q[:, None].expand(r, c, h, d).reshape(r * c, h, d)             # [R*c, H, D]
    cu = torch.arange(r * c + 1, device=q.device, dtype=torch.int32)
    out, lse = _fa4_call(q_rep, k_cache, v_cache, table, cu, used, scale, False, 1)   # [R*c, H, D], [R*c, H]
    empty = (used == 0)[:, None]                                           # the kernel's empty rows: 0 / -inf
    out = torch.where(empty[..., None], torch.zeros_like(out), out)
    lse = torch.where(empty, torch.full_like(lse, float("-inf")), lse)
    o, l = merge_stacked(out.view(r, c, h, d).transpose(0, 1), lse.view(r, c, h).transpose(0, 1))
    return o.to(q.dtype), l
