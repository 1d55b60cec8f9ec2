"""How many tokens of KV cache a worker's page pool holds.

    --kv-cache-tokens N          exactly N per worker (rounded down to whole pages)
    --gpu-memory-utilization U   (GPUs, default 0.9, vLLM's meaning) the share of the GPU's memory this
                                 worker may use for weights, activations and the KV pool together

On a GPU the pool gets what is left of U x total memory after what is in use (weights, the CUDA
context, other processes) and a reserve for the activations of the longest prefill a worker can
run: a prefill of T tokens on one worker needs about T x `activation_bytes_per_token` besides its
K/V, and one piece of its MLP's intermediates (`mlp_piece_bytes`). The estimate sums every tensor a
layer holds, so it errs on the safe side (before the MLP ran in pieces it was a little above a measured
prefill's peak). The longest prefill is the prompt a worker's pool could hold,
or max_model_len's share when that is shorter; with chunked prefill (--max-num-batched-tokens) on
flash-attn-4, one chunk's tokens (prefill_rows_reserved): the KV pool then takes nearly all the memory,
and a prompt several times longer fits (tests/engine/test_sizing.py's arithmetic; docs/benchmarks.md,
Capacity: the longest prompt on one GPU).
"""
from burstserve.engine.model.config import ModelConfig
from burstserve.engine.model.model import MLP_PIECE_ROWS
from burstserve.engine.model.moe import piece_elements_per_row
from burstserve.kernels.kv_quant import SCALE_BYTES, is_fp8

CPU_KV_TOKENS = 1 << 20       # a CPU worker's default (memory is touched only as pages are used)
CPU_KV_BYTES = 4 << 30        # ... at most this much address space


def kv_bytes_per_token(cfg: ModelConfig, num_kv_heads: int, itemsize: int, kv_cache_dtype: str = "auto") -> int:
    """K and V of one token over every layer: itemsize bytes an element in the model's dtype, or in FP8 one
    byte an element and one a (token, head) row for its scale (kernels/kv_quant.py)."""
    if is_fp8(kv_cache_dtype):
        return cfg.num_layers * 2 * num_kv_heads * (cfg.head_dim + SCALE_BYTES)
    return cfg.num_layers * 2 * num_kv_heads * cfg.head_dim * itemsize


def activation_bytes_per_token(cfg: ModelConfig, itemsize: int) -> int:
    """One layer's live tensors during a prefill, per token: residual, norm, qkv, rotated q/k, the
    K/V message and ring buffers, attention out (fp32 accumulators), the MLP's in and out. Its gate/up
    and silu*up are held for MLP_PIECE_ROWS rows at most (mlp_piece_bytes)."""
    h, hkv, d, hid = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
    activations = 4 * hid + 2 * (h + 2 * hkv) * d
    return itemsize * activations + 4 * (h * d + h)


def mlp_piece_bytes(cfg: ModelConfig, itemsize: int) -> int:
    """The MLP's gate/up [rows, 2 I] and silu*up [rows, I] (a sparse layer's: engine/model/moe.py) for the rows it runs
    at once (engine/model/model.py, LlamaModel.mlp: MLP_PIECE_ROWS; fewer in a shorter call, so this is a bound)."""
    return itemsize * max(3 * cfg.intermediate_size, piece_elements_per_row(cfg)) * MLP_PIECE_ROWS


def pool_tokens_on_gpu(budget_bytes: int, kv_per_token: int, act_per_token: int, prefill_tokens_max: int) -> int:
    """budget = U x total - in use. A worker that can hold T tokens may prefill T of them, so T x (kv + act)
    must fit; if max_model_len's share P is shorter than that, reserve P x act and give the rest to KV."""
    joint = budget_bytes // (kv_per_token + act_per_token)
    if joint >= prefill_tokens_max:
        return (budget_bytes - act_per_token * prefill_tokens_max) // kv_per_token
    return max(joint, 0)


def prefill_rows_reserved(share: int, chunk_tokens: int | None, max_num_seqs: int, min_rows: int,
                          gathers_context: bool) -> int:
    """The most tokens a worker runs through the layers in one call, which the activation reserve is for.
    Without chunked prefill: its share of the longest sequence (a prompt is prefilled in one call). With
    --max-num-batched-tokens C every earlier token of a long prompt is already in the paged KV cache, read
    in place by flash-attn-4, so a call holds at most C new tokens (a chunk, a short prompt, a chunk with the
    running sequences' decode rows), all of them on one worker in the worst case (a ring extend levels the
    workers' totals: after a prefix held unevenly one worker runs nearly all of a chunk; an extend below
    --extend-ring-min-tokens runs whole on every worker): C + max_num_seqs, and at least `min_rows` (the
    largest small-extend CUDA graph). Where attention gathers the cached K/V into dense tensors instead (no
    flash-attn-4), that gather grows with the context: the whole share stays."""
    if chunk_tokens is None or gathers_context:
        return share
    return min(share, max(chunk_tokens, min_rows) + max_num_seqs)


def pass_q_bytes(chunk_tokens: int, num_heads: int, head_dim: int, itemsize: int) -> int:
    """What a sharded chunk's pass-Q holds at once beside the rows' own activations (engine/runner/extend_attention.py,
    ExtendAttention._cached_partials_of_mine): every worker's queries of the chunk gathered [n, H, D], their
    partials over this worker's cache in fp32 [n, H, D], packed with the LSE [n, H, D + 1], and the packed
    partials received back [n, H, D + 1]. It grows with the whole chunk, not the worker's share of it."""
    per_token = num_heads * (head_dim * itemsize + 4 * head_dim + 2 * 4 * (head_dim + 1))
    return chunk_tokens * per_token


def fp8_gather_bytes(tokens: int, num_kv_heads: int, head_dim: int, itemsize: int) -> int:
    """What a chunk's attention over FP8 pages holds at once: one layer's K and V of `tokens` keys gathered
    from the pages and dequantized to the compute dtype (kernels.kv_quant.Fp8Pages.gather: the bytes, then
    the values). The gather goes a segment at a time (kernels.paged_attention.FP8_GATHER_SEGMENT), so
    tokens is at most a segment plus a chunk, whatever the context."""
    per_token = 2 * num_kv_heads * (head_dim * (itemsize + 1) + SCALE_BYTES)
    return tokens * per_token


def pool_tokens_on_cpu(kv_per_token: int) -> int:
    return min(CPU_KV_TOKENS, CPU_KV_BYTES // kv_per_token)
