"""FA3's FP8 arithmetic with q and k turned by one random-sign Hadamard rotation first (exact: q.k unchanged),
on SmolLM2 at 8K (issue 53). Variants of decomp.py's attention (2026-12-01-cpu-fa3-fp8-decomposition/)."""
import sys, os, json, time, torch
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-01-cpu-fa3-fp8-decomposition"))
import decomp

def hadamard(d):
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / d ** 0.5

ROT = {}
def rotation(d):
    if d not in ROT:
        g = torch.Generator().manual_seed(0)
        signs = torch.randint(0, 2, (d,), generator=g).float() * 2 - 1
        ROT[d] = signs[:, None] * hadamard(d)            # diag(signs) H: orthogonal
    return ROT[d]

_cast = decomp.cast
def cast(x, hkv, which):
    if which in ("q", "k") and decomp.MODE.get("rot"):
        r = rotation(x.shape[-1])
        y = x.float() @ r
        if decomp.MODE.get("rot") == "bf16":
            y = y.bfloat16()
        x = y.bfloat16() if decomp.MODE.get("rot") == "bf16" else y
    return _cast(x, hkv, which)
decomp.cast = cast
decomp.VARIANTS.update({
    "fa3-rot": {"rot": "fp32"},
    "fa3-rot-bf16": {"rot": "bf16"},
    "fa3-rot-exactv": {"rot": "fp32", "exact_v": 1},
})

if __name__ == "__main__":
    n = int(sys.argv[1]); names = sys.argv[2:]
    torch.set_num_threads(1)
    from transformers import AttentionInterface
    acc = decomp.acc
    model, tok = acc.load_model(); ids = acc.load_tokens(tok, n)
    AttentionInterface.register("decomp", decomp.attention_fn)
    acc.register_variants(["fp8-pages"])
    for name in names:
        t = time.time()
        if name == "fp8-pages":
            acc.set_attention(model, acc.attn_name("fp8-pages"))
        else:
            decomp.MODE.clear(); decomp.MODE.update(decomp.VARIANTS[name]); acc.set_attention(model, "decomp")
        ppl, _ = acc.perplexity(model, ids)
        print(json.dumps({"variant": name, "tokens": n, "ppl": ppl, "s": round(time.time() - t)}), flush=True)
