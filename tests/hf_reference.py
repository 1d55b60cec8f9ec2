"""transformers checkpoints made inside the tests, and transformers' own answers on them."""
import contextlib

import torch

from burstserve.kernels import fa3_fp8

TINY_SHAPE = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, initializer_range=0.08, max_position_embeddings=4096)


def make_config(kind: str):
    """'llama-mha', 'llama3-gqa' (llama3 RoPE scaling), 'qwen2' (qkv bias), 'qwen2-yarn' (with YaRN RoPE
    scaling x4 over a 512-token pretraining length: prompts past 512 tokens use the scaled part), 'qwen3'
    (Qwen3 dense: q and k normed per head; head_dim 24, not hidden / heads = 16) or 'qwen3-yarn'; the mixtures of
    experts 'qwen3-moe' (8 experts, top 2 renormalized, layer 1 dense: mlp_only_layers), 'mixtral' (4 experts, top
    2) and 'qwen2-moe' (6 experts, top 3 not renormalized, a gated shared expert, every second layer sparse); sliding
    windows: 'gemma3' (Gemma 3: windows of 40 tokens in five layers of six, their RoPE base 10K, the full layers'
    1M with linear scaling; head_dim 32, query_pre_attn_scalar 24), 'mistral-window' (every layer a window of 48)
    and 'qwen2-window' (use_sliding_window: layers from max_window_layers=1 on, windows of 37)."""
    from transformers import (Gemma3TextConfig, LlamaConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig,
                              Qwen3Config, Qwen3MoeConfig)
    if kind == "llama-mha":
        return LlamaConfig(**TINY_SHAPE, num_key_value_heads=4, rope_theta=10000.0)
    if kind == "llama3-gqa":
        return LlamaConfig(**TINY_SHAPE, num_key_value_heads=2, rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    if kind == "qwen2":
        return Qwen2Config(**TINY_SHAPE, num_key_value_heads=2, rope_theta=10000.0)
    if kind == "qwen2-yarn":
        return Qwen2Config(**TINY_SHAPE, num_key_value_heads=2, rope_theta=10000.0,
                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512})
    if kind == "qwen3":
        return Qwen3Config(**TINY_SHAPE, num_key_value_heads=2, head_dim=24, rope_theta=1000000.0)
    if kind == "qwen3-yarn":
        return Qwen3Config(**TINY_SHAPE, num_key_value_heads=2, head_dim=24, rope_theta=1000000.0,
                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512})
    if kind == "qwen3-moe":
        return Qwen3MoeConfig(**TINY_SHAPE, num_key_value_heads=2, head_dim=24, rope_theta=1000000.0, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True, mlp_only_layers=[1])
    if kind == "mixtral":
        return MixtralConfig(**TINY_SHAPE, num_key_value_heads=2, rope_theta=1000000.0, num_local_experts=4,
                             num_experts_per_tok=2)
    if kind == "qwen2-moe":
        return Qwen2MoeConfig(**TINY_SHAPE, num_key_value_heads=2, rope_theta=10000.0, num_experts=6,
                              num_experts_per_tok=3, moe_intermediate_size=40, shared_expert_intermediate_size=72,
                              decoder_sparse_step=2, norm_topk_prob=False)
    if kind == "gemma3":
        shape = dict(TINY_SHAPE, num_hidden_layers=7)
        return Gemma3TextConfig(**shape, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=24,
                                sliding_window=40, rope_parameters={
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0}})
    if kind == "mistral-window":
        return MistralConfig(**TINY_SHAPE, num_key_value_heads=2, rope_theta=10000.0, sliding_window=48)
    if kind == "qwen2-window":
        return Qwen2Config(**TINY_SHAPE, num_key_value_heads=2, rope_theta=10000.0, use_sliding_window=True,
                           sliding_window=37, max_window_layers=1)
    raise ValueError(kind)


def save_checkpoint(kind: str, path: str, seed: int) -> torch.nn.Module:
    """A random-weight model of that kind saved with save_pretrained; returns the model (fp32, eval)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(kind), torch_dtype=torch.float32).eval()
    with torch.no_grad():   # biases are zero and norm weights one at init; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.normal_(1, 0.3)
            elif "layernorm" in name or name.endswith("norm.weight"):   # Gemma's are zeros (they scale by 1 + w)
                p.normal_(p.mean().item(), 0.3)
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "shared_expert_gate.weight")):
                p.normal_(0, 0.5)                  # routers: zeros at init would tie every expert
    model.save_pretrained(path)
    return model


@torch.no_grad()
def hf_next_logits_and_greedy(model, prompt: list[int], num_tokens: int) -> tuple[torch.Tensor, list[int]]:
    """transformers' next-token logits [V] after the prompt, and its greedy continuation."""
    ids = torch.tensor([prompt])
    out = model(ids, use_cache=True)
    first_logits = out.logits[0, -1].float()
    past, token, tokens = out.past_key_values, int(first_logits.argmax()), []
    for _ in range(num_tokens):
        tokens.append(token)
        if len(tokens) == num_tokens:
            break
        out = model(torch.tensor([[token]]), past_key_values=past, use_cache=True)
        past, token = out.past_key_values, int(out.logits[0, -1].argmax())
    return first_logits, tokens


@torch.no_grad()
def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    """transformers' greedy tokens, each from a full forward pass without its KV cache."""
    ids = list(prompt)
    for _ in range(num_tokens):
        ids.append(int(model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
    return ids[len(prompt):]


def assert_same_greedy(model, prompt: list[int], got: list[int], want: list[int], what, tolerance: float = 1e-3):
    """got == want (greedy tokens), or they part at a near-tie: at the first step where they differ,
    transformers' own logits (a full forward pass over the prompt and the tokens before it, no cache)
    rate the two tokens within `tolerance` (10x the logit error the tests allow; a wrong K/V moves
    logits by far more). After the parting the histories differ, so nothing more is compared."""
    assert len(got) == len(want), what
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            logits = model(torch.tensor([prompt + got[:i]]), use_cache=False).logits[0, -1].float()
            margin = (logits[a] - logits[b]).abs().item()
            assert margin <= tolerance, (what, f"token {i}: {a} vs transformers' {b}, logit margin {margin:.2e}")
            return


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def save_tokenizer(path: str, vocab_size: int = 320) -> None:
    """A byte-level BPE tokenizer built here (nothing downloaded), saved in transformers' format: the
    256 byte symbols, <s> and </s>, and letter-pair merges up to the test models' whole vocabulary
    (320), so every generated id decodes to text."""
    import itertools
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {sym: i for i, sym in enumerate(symbols)}
    vocab.update({"<s>": len(vocab), "</s>": len(vocab) + 1})
    pairs = itertools.islice(itertools.product("etaoinshrd", repeat=2), vocab_size - len(vocab))
    merges = []
    for a, b in pairs:
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    assert tok.get_vocab_size() == vocab_size
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def assert_same_logprobs(got: dict[int, float], want: dict[int, float], tol: float, what: str = "") -> None:
    """One position's logprobs ({token: logprob}, the top k and the chosen) equal within tol. Two
    runs that sum in another order may list another token at the top-k cut when two candidates
    tie there (seen in CI: 2nd and 3rd within 1e-6), so a token listed by one run only must lie
    within tol of the other run's lowest listed logprob; every token both list agrees within tol."""
    assert len(got) == len(want), (what, got, want)
    for token in got.keys() & want.keys():
        assert abs(got[token] - want[token]) <= tol, (what, token, got, want)
    for mine, other in ((got, want), (want, got)):
        for token in mine.keys() - other.keys():
            assert abs(mine[token] - min(other.values())) <= tol, (what, "not a tie at the cut", got, want)


@contextlib.contextmanager
def kv_rounded(model, round_kv):
    """transformers' model with every layer's K (after RoPE) and V passed through round_kv ([..., D] -> the
    same shape and dtype) before its attention sees them or its cache keeps them: the reference of a KV
    cache that stores K/V rounded (an FP8 cache). Patches the model's RoPE function (Llama, Qwen2, Qwen3, Mistral,
    Gemma 3) and
    hooks each v_proj; both undone on exit."""
    from transformers.models.gemma3 import modeling_gemma3
    from transformers.models.llama import modeling_llama
    from transformers.models.mistral import modeling_mistral
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3
    modules = (modeling_llama, modeling_qwen2, modeling_qwen3, modeling_mistral, modeling_gemma3)
    originals = [m.apply_rotary_pos_emb for m in modules]

    def rounded_rope(original):
        def rope(q, k, cos, sin, *args, **kwargs):
            q, k = original(q, k, cos, sin, *args, **kwargs)
            return q, round_kv(k)                                     # k [B, Hkv, S, D]
        return rope

    def round_v(module, inputs, out):                                 # out [B, S, Hkv * D]
        d = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
        return round_kv(out.unflatten(-1, (-1, d))).flatten(-2)

    hooks = [layer.self_attn.v_proj.register_forward_hook(round_v) for layer in model.model.layers]
    for m, original in zip(modules, originals):
        m.apply_rotary_pos_emb = rounded_rope(original)
    try:
        yield model
    finally:
        for m, original in zip(modules, originals):
            m.apply_rotary_pos_emb = original
        for h in hooks:
            h.remove()


def dense_causal_attend(layer, q, k, v):
    """An `attend` for engine.model.LlamaModel.forward on one whole sequence: q [n, H, D], k, v [n, Hkv, D]
    -> causal attention [n, H, D] in fp32 by torch's SDPA (GQA by repeating K/V)."""
    import torch.nn.functional as F
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out = F.scaled_dot_product_attention(*(t.transpose(0, 1)[None].float() for t in (q, k, v)), is_causal=True)
    return out[0].transpose(0, 1).to(q.dtype)


def fa3_like_reference(q, k, v, causal: bool, scale: float):
    """FA3's FP8 forward in float64, dense, written apart from kernels/fa3_fp8.py: q, k, v [S, Hx, D] each cast to
    e4m3 with amax / 448 per KV head (q over the group's query heads; the descale rounded to fp32, as FA3 takes
    it), S = q8 k8^T * descales * scale, causal aligned to the end; P = exp(S - its row max) * 256 cast to e4m3
    and P8 v8 * v's descale / (256 sum P) in bf16 (FA3's output dtype for FP8 operands) -> (out [Sq, H, D]
    float64, lse [Sq, H]).
    First q and k turned by the kernel's rotation (fa3_fp8.rotation, +-1 entries, R R^T = D I:
    tests/kernels/test_fa3_fp8.py checks it) in their dtype, as the kernel turns them (turned in float64, their
    e4m3 roundings would tip apart), the softmax scale divided by D."""
    sq, h, d = q.shape
    sk, hkv, _ = k.shape
    g = h // hkv
    turn = fa3_fp8.rotation(d, q.dtype, q.device)
    if turn is not None:
        q, k, scale = q @ turn, k @ turn, scale / d

    def cast(x):                                                   # [S, Hx, D] -> e4m3 values, [Hkv] descales
        per_kv = x.double().reshape(x.shape[0], hkv, -1)
        descale = (per_kv.abs().amax(dim=(0, 2)) / 448.0).float().double()    # fp32, as FA3 takes its descales
        x8 = (per_kv / descale[None, :, None]).float().clamp(-448, 448).to(torch.float8_e4m3fn).double()
        return x8.reshape(x.shape), descale

    (q8, qd), (k8, kd), (v8, vd) = cast(q), cast(k), cast(v)
    kh, vh = k8.repeat_interleave(g, 1), v8.repeat_interleave(g, 1)              # [Sk, H, D]
    per_head = lambda t: t.repeat_interleave(g)                                  # noqa: E731  [Hkv] -> [H]
    s = torch.einsum("qhd,khd->hqk", q8, kh) * (per_head(qd) * per_head(kd) * scale)[:, None, None]
    if causal:
        s = s.masked_fill(torch.arange(sk)[None, :] > torch.arange(sq)[:, None] + (sk - sq), float("-inf"))
    m = s.amax(-1, keepdim=True)                                                 # [H, Sq, 1]
    seen = torch.isfinite(m)
    p = torch.exp(s - torch.where(seen, m, 0.0))
    p8 = (p * 256).float().to(torch.float8_e4m3fn).double()
    total = p.sum(-1, keepdim=True)
    o = torch.einsum("hqk,khd->hqd", p8, vh) * per_head(vd)[:, None, None] / (256 * total.clamp(min=1e-300))
    out = o.to(torch.bfloat16).double() * seen                                   # the call's output in bf16
    lse = torch.where(seen, m + torch.log(total), float("-inf"))
    return out.transpose(0, 1), lse.squeeze(-1).T


def _exact_partial(q, k, v, scale: float):
    """q [m, H, D] against k, v [n, Hkv, D], no mask, float64 -> (out [m, H, D], lse [m, H])."""
    g = q.shape[1] // k.shape[1]
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(g, 1)) * scale
    lse = torch.logsumexp(s, -1)                                                   # [H, m]
    out = torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), v.double().repeat_interleave(g, 1))
    return out, lse.T


def fa3_fp8_chunked(q, k, v, scale: float, bounds: list[int], round_cached=None):
    """The engine's prompt in chunks with FP8 attention (ExtendAttention._fresh_in_fp8), written apart: chunk
    [a, b)'s queries attend over FP8 pages (round_cached gives their values back) the cached keys [0, a) as the
    pages hold them and its own K/V unrounded, in one fa3_like_reference call, causal aligned to the end (a
    context of fewer keys than kernels.paged_attention's FP8_GATHER_SEGMENT); over bf16 pages (round_cached
    None) its own K/V with fa3_like_reference (causal) and the cached keys exactly, merged by LSE. q [S, H, D],
    k, v [S, Hkv, D] -> out [S, H, D] float64."""
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1], dtype=torch.float64)
    for a, b in zip(bounds[:-1], bounds[1:]):
        if round_cached is not None:
            keys = torch.cat([round_cached(k[:a]), k[a:b]])
            values = torch.cat([round_cached(v[:a]), v[a:b]])
            out[a:b] = fa3_like_reference(q[a:b], keys, values, True, scale)[0]
            continue
        fresh, fresh_lse = fa3_like_reference(q[a:b], k[a:b], v[a:b], True, scale)
        if a == 0:
            out[a:b] = fresh
            continue
        cached, cached_lse = _exact_partial(q[a:b], k[:a], v[:a], scale)
        lse = torch.logaddexp(fresh_lse, cached_lse)                               # [m, H]
        out[a:b] = (fresh * torch.exp(fresh_lse - lse)[..., None] + cached * torch.exp(cached_lse - lse)[..., None])
    return out


@contextlib.contextmanager
def fa3_fp8_attention_in(model, bounds: list[int] | None = None, round_cached=None):
    """transformers' model with every attention call replaced by FA3's FP8 arithmetic: fa3_like_reference over the
    whole call's q, k, v (what the engine's one-call prefill on one worker runs), or with `bounds` the prompt in
    those chunks (fa3_fp8_chunked); undone on exit."""
    from transformers import AttentionInterface

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query [1, H, Sq, D], key, value [1, Hkv, Sk, D] -> ([1, Sq, H, D], None)
        rows = lambda t: t[0].transpose(0, 1)                              # noqa: E731  [S, H, D]
        if bounds is None:
            out, _ = fa3_like_reference(rows(query), rows(key), rows(value), True, scaling)
        else:
            out = fa3_fp8_chunked(rows(query), rows(key), rows(value), scaling, bounds, round_cached)
        return out.to(query.dtype)[None], None

    AttentionInterface.register("fa3-fp8-reference", attention)
    before = model.config._attn_implementation
    model.set_attn_implementation("fa3-fp8-reference")
    try:
        yield model
    finally:
        model.set_attn_implementation(before)
