"""burstserve.kernels.fused: the torch path against transformers' LLaMA pieces, and the Triton kernels (run on
CPU through Triton's interpreter, in a fresh process) against the torch path. Fresh random inputs."""
import torch
import torch.nn.functional as F

from burstserve.kernels import fused
from burstserve.kernels.arith import next_pow2
from triton_interpreter import run_interpreted


def test_rms_norm_matches_transformers_with_and_without_residual():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    for dtype in (torch.float32, torch.bfloat16):
        norm = LlamaRMSNorm(96, eps=1e-5)
        norm.weight.data = torch.randn(96).to(dtype)
        norm = norm.to(dtype)
        x, r = torch.randn(7, 96).to(dtype), torch.randn(7, 96).to(dtype)
        assert torch.equal(fused.rms_norm(x, norm.weight, 1e-5), norm(x))
        out, res = fused.rms_norm(x, norm.weight, 1e-5, residual=r)
        assert torch.equal(res, x + r) and torch.equal(out, norm(x + r))


def test_rope_in_place_matches_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from burstserve.engine.model.config import ModelConfig
    from burstserve.engine.model.rope import inverse_frequencies, rope_cos_sin
    h, hkv, d, s = 6, 2, 16, 9
    cfg = ModelConfig(vocab_size=10, hidden_size=h * d, intermediate_size=8, num_layers=1, num_heads=h,
                      num_kv_heads=hkv, head_dim=d, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=64)
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(s, (h + 2 * hkv) * d).to(dtype)
        positions = torch.randint(0, 1000, (s,))
        cos, sin = rope_cos_sin(inverse_frequencies(cfg), positions, dtype)
        q, k, v = (t.clone() for t in qkv.split([h * d, hkv * d, hkv * d], dim=-1))
        ref_q, ref_k = apply_rotary_pos_emb(q.view(1, s, h, d).transpose(1, 2), k.view(1, s, hkv, d).transpose(1, 2),
                                            cos[None], sin[None])
        fused.rope_(qkv, cos, sin, h, hkv)
        out_q, out_k, out_v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
        assert torch.equal(out_q.view(s, h, d), ref_q[0].transpose(0, 1))
        assert torch.equal(out_k.view(s, hkv, d), ref_k[0].transpose(0, 1))
        assert torch.equal(out_v, v)


def test_silu_and_mul_and_store_kv():
    x = torch.randn(5, 2 * 24)
    assert torch.equal(fused.silu_and_mul(x), F.silu(x[:, :24]) * x[:, 24:])
    k_cache, v_cache = torch.randn(4, 8, 2, 16), torch.randn(4, 8, 2, 16)
    kv = torch.randn(3, 2, 2, 16)
    slots = torch.tensor([31, 0, 9])
    before = k_cache.clone()
    fused.store_kv(k_cache, v_cache, slots, kv[:, 0], kv[:, 1])
    assert torch.equal(k_cache.view(32, 2, 16)[slots], kv[:, 0]) and torch.equal(v_cache.view(32, 2, 16)[slots], kv[:, 1])
    keep = torch.ones(32, dtype=torch.bool)
    keep[slots] = False
    assert torch.equal(k_cache.view(32, 2, 16)[keep], before.view(32, 2, 16)[keep])


# ---------------------------------------------------------------- Triton, interpreted on CPU

def _triton_interpreted_checks():
    """Every kernel against the torch path at odd sizes, fp32 and bf16 (needs TRITON_INTERPRET=1
    before triton's first import: test_fused_triton_kernels_interpreted runs it in a fresh process).
    fp32: the same bits where no sum is reordered. bf16: within rounding, because the interpreter
    rounds fp32 -> bf16 otherwise than CUDA (tests/gpu/test_kernels_gpu.py checks the bits there)."""
    kern = fused._build()
    assert type(kern["rope"]).__name__ == "InterpretedFunction"
    for dtype in (torch.float32, torch.bfloat16):
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=2e-2)   # bf16: 2 roundings, ~2 ulps
        w = torch.randn(100).to(dtype)
        x, r = torch.randn(6, 120).to(dtype)[:, :100], torch.randn(6, 100).to(dtype)   # x: rows strided
        torch.testing.assert_close(fused._rms_norm_triton(kern["rms_norm"], x, w, 1e-5, None),
                                   fused._rms_norm_torch(x, w, 1e-5), **tol)
        same = torch.equal if dtype == torch.float32 else lambda a, b: torch.testing.assert_close(a, b, **tol) or True
        out, res = fused._rms_norm_triton(kern["rms_norm"], x, w, 1e-5, r)
        assert same(res, x + r)
        torch.testing.assert_close(out, fused._rms_norm_torch(x + r, w, 1e-5), **tol)

        h, hkv, d, s = 5, 3, 16, 4
        qkv = torch.randn(s, (h + 2 * hkv) * d).to(dtype)
        cos, sin = torch.randn(s, d).to(dtype), torch.randn(s, d).to(dtype)
        ref = qkv.clone()
        rot = ref[:, :(h + hkv) * d].view(s, h + hkv, d)
        rot.copy_(fused._rope_torch(rot, cos[:, None], sin[:, None]))
        fused._rope_triton(kern["rope"], qkv, cos, sin, h, hkv)
        if dtype == torch.float32:
            assert torch.equal(qkv, ref)                     # the same roundings, the same bits
        else:                                                # two rounded products summed: 2 ulps of |x| <= 4
            torch.testing.assert_close(qkv, ref, atol=4e-2, rtol=2e-2)

        # Qwen3's q/k head norms, then RoPE, in place: q's heads take q_norm, k's k_norm, v untouched; against fp64
        qkv = (torch.randn(s, (h + 2 * hkv) * d) * 3).to(dtype)
        qw, kw = torch.randn(d).to(dtype), torch.randn(d).to(dtype)
        want = qkv.double().clone()
        for heads, start, wt in ((h, 0, qw), (hkv, h * d, kw)):
            part = want[:, start:start + heads * d].view(s, heads, d)
            part.copy_(wt.double() * part * torch.rsqrt(part.pow(2).mean(-1, keepdim=True) + 1e-6))
        rot = want[:, :(h + hkv) * d].view(s, h + hkv, d)
        rot.copy_(fused._rope_torch(rot, cos.double()[:, None], sin.double()[:, None]))
        torched = qkv.clone()
        fused._triton.enabled = False
        try:
            fused.rope_(torched, cos, sin, h, hkv, (qw, kw, 1e-6))      # the torch ops (the CPU's path)
        finally:
            fused._triton.enabled = True
        fused._rope_triton(kern["rope"], qkv, cos, sin, h, hkv, (qw, kw, 1e-6))
        for got in (qkv, torched):
            torch.testing.assert_close(got.double(), want, atol=0.3 if dtype == torch.bfloat16 else 1e-4,
                                       rtol=2e-2 if dtype == torch.bfloat16 else 1e-5)
        # bf16: four roundings (norm, weight, two products) of |x| up to about 10, each a truncation here
        torch.testing.assert_close(qkv, torched, **(tol if dtype == torch.float32 else dict(atol=0.15, rtol=2e-2)))

        gate_up = torch.randn(3, 2 * 1500).to(dtype)         # two blocks of I, the second partial
        torch.testing.assert_close(fused._silu_and_mul_triton(kern["silu_and_mul"], gate_up),
                                   F.silu(gate_up[:, :1500]) * gate_up[:, 1500:], **tol)

        # the norm and the silu with the per-token FP8 quantization in the same kernel: the bits of the two
        # kernels one after the other (the same arithmetic, the bf16 row rounded as the first would store it)
        def quantized(y):
            q, sc = torch.empty(y.shape, dtype=torch.float8_e4m3fn), torch.empty(y.shape[0], 1)
            kern["quantize_fp8"][(y.shape[0],)](y, q, sc, y.shape[1], y.stride(0), BLOCK=next_pow2(y.shape[1]))
            return q.view(torch.uint8), sc

        q, sc, res = fused._rms_norm_fp8_triton(kern["rms_norm_fp8"], x, w, 1e-5, r)
        out, res_ref = fused._rms_norm_triton(kern["rms_norm"], x, w, 1e-5, r)
        want_q, want_s = quantized(out)
        assert torch.equal(q.view(torch.uint8), want_q) and torch.equal(sc, want_s) and torch.equal(res, res_ref)
        q, sc = fused._rms_norm_fp8_triton(kern["rms_norm_fp8"], x, w, 1e-5, None)
        assert torch.equal(q.view(torch.uint8), quantized(fused._rms_norm_triton(kern["rms_norm"], x, w, 1e-5, None))[0])
        q, sc = fused._silu_and_mul_fp8_triton(kern["silu_and_mul_fp8"], gate_up)
        want_q, want_s = quantized(fused._silu_and_mul_triton(kern["silu_and_mul"], gate_up))
        assert torch.equal(q.view(torch.uint8), want_q) and torch.equal(sc, want_s)

        kc, vc = torch.randn(4, 8, 3, 16).to(dtype), torch.randn(4, 8, 3, 16).to(dtype)
        ref_k, ref_v = kc.clone(), vc.clone()
        kv = qkv.view(s, h + 2 * hkv, d)                    # k, v as views into qkv, as the model passes them
        k, v = kv[:, h:h + hkv], kv[:, h + hkv:]
        slots = torch.tensor([31, 0, 9, 17])
        ref_k.view(32, 3, 16).index_copy_(0, slots, k)
        ref_v.view(32, 3, 16).index_copy_(0, slots, v)
        fused._store_kv_triton(kern["store_kv"], kc, vc, slots, k, v)
        assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)


def test_fused_triton_kernels_interpreted():
    run_interpreted("test_fused")
