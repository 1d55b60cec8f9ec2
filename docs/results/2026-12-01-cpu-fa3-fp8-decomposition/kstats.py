import sys, torch
import os
ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "scripts"))
import fp8_attention_accuracy as acc
torch.set_num_threads(1)
model, tok = acc.load_model(); ids = acc.load_tokens(tok, 2048)
rows = {}
def hook(name):
    def f(mod, inp, out):
        rows[name] = out[0].detach()  # [S, Hkv*D]
    return f
for i, layer in enumerate(model.model.layers):
    layer.self_attn.k_proj.register_forward_hook(hook(("k", i)))
    layer.self_attn.q_proj.register_forward_hook(hook(("q", i)))
    layer.self_attn.v_proj.register_forward_hook(hook(("v", i)))
with torch.no_grad():
    model(ids, use_cache=False)
cfg = model.config; hkv = cfg.num_key_value_heads; d = cfg.hidden_size // cfg.num_attention_heads
print("note: k/q before RoPE (rope rotates pairs: amax per token changes a little)")
for kind in ("k", "q", "v"):
    worst = []
    for i in range(cfg.num_hidden_layers):
        x = rows[(kind, i)]
        h = x.shape[1] // d
        x = x.view(x.shape[0], hkv, (h // hkv) * d)
        tok_amax = x.abs().amax(-1)                       # [S, Hkv]
        for hh in range(hkv):
            t = tok_amax[:, hh]
            top = torch.topk(t, 5)
            ratio = (top.values[0] / t.median()).item()
            worst.append((ratio, i, hh, top.indices.tolist(), [round(v, 1) for v in top.values.tolist()], round(t.median().item(), 2)))
    worst.sort(reverse=True)
    print(kind, "largest (token amax / median token amax) per (layer, kv head):")
    for w in worst[:8]:
        print("   ratio %.1f layer %d head %d top tokens %s values %s median %s" % w)
    print(kind, "median ratio over (layer, head): %.1f" % sorted(w[0] for w in worst)[len(worst)//2])
