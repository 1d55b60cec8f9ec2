"""The last prompt position's top logits at 2048 tokens for bf16, fp8-pages and fa3-fp8 (why the greedy count is 0)."""
import sys, torch
sys.path.insert(0, "scripts"); sys.path.insert(0, ".")
import fp8_attention_accuracy as acc
torch.set_num_threads(2)
model, tok = acc.load_model(); ids = acc.load_tokens(tok, 2048)
acc.register_variants(["bf16", "fp8-pages", "fa3-fp8"])
for name in ["bf16", "fp8-pages", "fa3-fp8"]:
    acc.set_attention(model, acc.attn_name(name))
    ppl, last = acc.perplexity(model, ids)
    top = torch.topk(last, 4)
    print(name, round(ppl, 4), top.indices.tolist(), [round(x, 3) for x in top.values.tolist()], "l[11943]", round(last[11943].item(), 3), "l[51]", round(last[51].item(), 3), flush=True)
print(repr(tok.decode(ids[0, -12:])), repr(tok.decode([11943])), repr(tok.decode([51])))
