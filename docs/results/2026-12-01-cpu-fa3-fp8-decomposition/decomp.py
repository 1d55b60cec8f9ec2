"""Where FA3's FP8 error comes from on SmolLM2 at 8K (issue 53): variants of kernels/fa3_fp8.py's torch path."""
import sys, time, json, torch
import os
ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "scripts"))
import fp8_attention_accuracy as acc
import kernels.fa3_fp8 as f
from kernels.kv_quant import FP8, FP8_MAX

MODE = {}

def e4(x):  # fp32 -> e4m3 rounded, back
    return x.to(FP8).float()

def torch_call(q8, k8, v8, qd, kd, vd, causal, scale):
    sq, h, d = q8.shape; sk, hkv, _ = k8.shape; g = h // hkv
    kf, vf = k8.float(), v8.float()
    ss = (qd * kd * scale)[:, None, None, None]
    out = torch.empty(sq, h, d); lse = torch.empty(sq, h)
    tile = MODE.get("tile")
    for a in range(0, sq, 1024):
        b = min(a + 1024, sq)
        qc = q8[a:b].float().view(b - a, hkv, g, d)
        s = torch.einsum("qhgd,khd->hgqk", qc, kf) * ss
        rows = torch.arange(a, b) + (sk - sq)
        s.masked_fill_(torch.arange(sk)[None, :] > rows[:, None], float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m); tot = p.sum(-1, keepdim=True)
        pr = MODE.get("p", "fa3")
        if pr == "none":
            p8 = p
        elif tile:  # P against each tile's own maximum, then scaled back
            n = s.shape[-1]; pad = (-n) % tile
            sp = torch.nn.functional.pad(s, (0, pad), value=float("-inf"))
            st = sp.view(*sp.shape[:-1], -1, tile)
            mt = st.amax(-1, keepdim=True)
            mt = torch.where(torch.isfinite(mt), mt, m[..., None])
            pt = e4(torch.exp(st - mt) * 256) / 256 * torch.exp(mt - m[..., None])
            p8 = pt.view(*sp.shape)[..., :n]
        else:
            p8 = e4(p * 256) / 256
        o = torch.einsum("hgqk,khd->qhgd", p8, vf) * vd[None, :, None, None] / tot.permute(2, 0, 1, 3)
        out[a:b] = o.reshape(b - a, h, -1)
        lse[a:b] = (m + torch.log(tot)).squeeze(-1).reshape(h, b - a).transpose(0, 1)
    return out, lse

def cast(x, hkv, which):
    if MODE.get("exact_" + which):
        return x.float(), torch.ones(hkv)
    if MODE.get("block_" + which):                       # one scale per (block of rows, KV head group)
        s_, h_, d_ = x.shape
        bsz = MODE["block_" + which]
        g_ = x.view(s_, hkv, (h_ // hkv) * d_).float()
        pad = (-s_) % bsz
        gp = torch.nn.functional.pad(g_, (0, 0, 0, 0, 0, pad)).view(-1, bsz, hkv, g_.shape[-1])
        sc = (gp.abs().amax(dim=(1, 3), keepdim=True) / FP8_MAX).clamp(min=2.0 ** -126)
        y = ((gp / sc).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * sc).view(-1, hkv, g_.shape[-1])[:s_]
        return y.reshape(s_, h_, d_), torch.ones(hkv)
    if MODE.get("token_" + which):                       # one scale per (token, KV head group), dequantized
        s_, h_, d_ = x.shape
        g_ = x.view(s_, hkv, (h_ // hkv) * d_).float()
        sc = (g_.abs().amax(-1, keepdim=True) / FP8_MAX).clamp(min=2.0 ** -126)
        return ((g_ / sc).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * sc).view(s_, h_, d_), torch.ones(hkv)
    return f.to_e4m3(x, hkv)

def attention_fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    rows = lambda x: x[0].float().transpose(0, 1).contiguous().bfloat16()
    q, k, v = rows(query), rows(key), rows(value)
    hkv = k.shape[1]
    vmean = None
    if MODE.get("smooth_k"):
        k = (k.float() - k.float().mean(0, keepdim=True)).bfloat16()
    if MODE.get("smooth_v"):
        vmean = v.float().mean(0, keepdim=True)                     # [1, Hkv, D]
        v = (v.float() - vmean).bfloat16()
    (q8, qd), (k8, kd), (v8, vd) = cast(q, hkv, "q"), cast(k, hkv, "k"), cast(v, hkv, "v")
    out, _ = torch_call(q8, k8, v8, qd, kd, vd, True, scaling)
    if vmean is not None:
        g = q.shape[1] // hkv
        out = out + vmean.repeat_interleave(g, dim=1)
    return out.unsqueeze(0).to(query.dtype), None

VARIANTS = {
    "fa3": {},
    "fa3-noP": {"p": "none"},
    "fa3-Ponly": {"exact_q": 1, "exact_k": 1, "exact_v": 1},
    "fa3-exactq": {"exact_q": 1},
    "fa3-exactk": {"exact_k": 1},
    "fa3-exactv": {"exact_v": 1},
    "fa3-smoothk": {"smooth_k": 1},
    "fa3-smoothkv": {"smooth_k": 1, "smooth_v": 1},
    "fa3-tile128": {"tile": 128},
    "fa3-tokq": {"token_q": 1},
    "fa3-blockq128": {"block_q": 128},
    "fa3-tokk": {"token_k": 1},
    "fa3-tokqk": {"token_q": 1, "token_k": 1},
    "fa3-tokqkv": {"token_q": 1, "token_k": 1, "token_v": 1},
    "fa3-tile128-smoothkv": {"tile": 128, "smooth_k": 1, "smooth_v": 1},
}

if __name__ == "__main__":
    n = int(sys.argv[1]); names = sys.argv[2:]
    torch.set_num_threads(1)
    from transformers import AttentionInterface
    model, tok = acc.load_model(); ids = acc.load_tokens(tok, n)
    AttentionInterface.register("decomp", attention_fn)
    acc.register_variants(["fp8-pages"])
    for name in names:
        t = time.time()
        if name == "fp8-pages":
            acc.set_attention(model, acc.attn_name("fp8-pages"))
        else:
            MODE.clear(); MODE.update(VARIANTS[name]); acc.set_attention(model, "decomp")
        ppl, _ = acc.perplexity(model, ids)
        print(json.dumps({"variant": name, "tokens": n, "ppl": ppl, "s": round(time.time() - t)}), flush=True)
