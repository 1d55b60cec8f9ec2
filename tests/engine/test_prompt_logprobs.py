"""Prompt logprobs (vLLM's `prompt_logprobs`) equal transformers' log-softmax over the whole prompt,
whichever worker held each position."""
import random

import pytest
import torch

from burstserve.engine import LLM, InvalidRequestError, SamplingParams
from hf_reference import save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("prompt-logprobs"))
    return path, save_checkpoint("llama3-gqa", path, seed=random.randrange(1 << 30))


@pytest.mark.parametrize("strategy,workers", [("burst", 3), ("tp", 2), ("tp-v3", 2), ("cqs", 3), ("single", 1),
                                              ("burst-zero", 2)])
def test_prompt_logprobs_match_transformers(checkpoint, strategy, workers):
    path, model = checkpoint
    prompts = [[random.randrange(320) for _ in range(n)] for n in (1, 2, 37, 1100)]   # 1100 > one scoring chunk
    top = 3
    with LLM(path, devices="cpu", context_parallel_size=workers, dtype="float32", sp_strategy=strategy) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=top))
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)   # [N, V]
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for p in range(1, len(prompt)):
            entry, row = entries[p], ref[p - 1]
            assert abs(entry[prompt[p]] - row[prompt[p]].item()) <= 1e-4, (strategy, len(prompt), p)
            assert top <= len(entry) <= top + 1     # the top tokens, and the prompt's own if not among them
            for t, lp in entry.items():
                assert abs(lp - row[t].item()) <= 1e-4, (strategy, len(prompt), p, t)
            # the top values (not ids: near-ties may swap which token is k-th)
            best = sorted(entry.values(), reverse=True)[:top]
            assert best == pytest.approx(torch.topk(row, top).values.tolist(), abs=1e-4)


def test_prompt_logprobs_are_checked_and_optional(checkpoint):
    with pytest.raises(InvalidRequestError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)
    with LLM(checkpoint[0], devices="cpu", context_parallel_size=2, dtype="float32") as llm:
        prompt = [random.randrange(320) for _ in range(20)]
        plain, scored, again = llm.generate([prompt] * 3, [SamplingParams(max_tokens=4, temperature=0),
                                                           SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0),
                                                           SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=0)])
    assert plain.prompt_logprobs is None
    assert scored.prompt_logprobs == again.prompt_logprobs and len(scored.prompt_logprobs[5]) == 1
    assert not again.metrics.prefill_stats.shared_prefill   # prompt logprobs come out of a prefill
    assert scored.outputs[0].token_ids == plain.outputs[0].token_ids
