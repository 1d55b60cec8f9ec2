"""Structured output: OpenAI's response_format through xgrammar, on the byte-tokenizer `tiny` preset and
on a transformers checkpoint with a byte-level BPE tokenizer; random prompts and seeds each run."""
import json
import os
import random

import pytest
import torch

from burstserve.engine import LLM, InvalidRequestError, SamplingParams
from burstserve.engine.core.structured_output import (GrammarBackend, check_tokenizer, parse_response_format,
                                                 tokenizer_source)
from burstserve.engine.core.tokenizer import NoTokenizer
from hf_reference import save_checkpoint, save_tokenizer

NAMES = ["ada", "bob", "cy"]
TAGS = ["x", "yz"]
SCHEMA = {"type": "object",
          "properties": {"name": {"enum": NAMES},
                         "age": {"type": "integer", "minimum": 18, "maximum": 99},
                         "member": {"type": "boolean"},
                         "tags": {"type": "array", "items": {"enum": TAGS}, "maxItems": 2}},
          "required": ["name", "age", "member", "tags"], "additionalProperties": False}
PERSON = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
OBJECT = {"type": "json_object"}
MAX_PERSON_TOKENS = 80     # the longest person is 65 bytes (one line, no free whitespace), plus the stop token


@pytest.fixture(scope="module", params=["tiny", "hf"])
def llm(request, tmp_path_factory):
    if request.param == "tiny":
        model, kwargs = "tiny", {}
    else:
        model = str(tmp_path_factory.mktemp("llama-bpe"))
        save_checkpoint("llama-mha", model, seed=random.randrange(1 << 30))
        save_tokenizer(model)
        with open(os.path.join(model, "config.json")) as f:   # the tokenizer's <s> and </s> (ids 256, 257)
            config = json.load(f)
        config.update(bos_token_id=256, eos_token_id=257)
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(config, f)
        kwargs = {"max_model_len": 256}
    with LLM(model, devices="cpu", dtype="float32", **kwargs) as engine:
        yield engine


def _prompt(llm, n=None):
    words = ["".join(random.choices("etaoin shrd{}\":,", k=random.randrange(1, 8))) for _ in range(n or 6)]
    return llm.encode(" ".join(words))


def _check_person(text):
    value = json.loads(text)
    assert isinstance(value, dict) and list(value) == ["name", "age", "member", "tags"], text
    assert value["name"] in NAMES and isinstance(value["member"], bool), text
    assert type(value["age"]) is int and 18 <= value["age"] <= 99, text
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 2 and all(t in TAGS for t in value["tags"]), text
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(value, SCHEMA)


def _matcher(llm, response_format):
    """A matcher of this test's own, to check that tokens the engine generated follow the grammar."""
    source = tokenizer_source(llm.engine.model, llm.engine.is_preset, llm.model_config.vocab_size,
                              llm.model_config.eos_token_ids, llm.tokenizer.eos_token_id)
    return GrammarBackend(source, llm.tokenizer).matcher(parse_response_format(response_format))


def test_json_schema_outputs_match_the_schema_and_stop(llm):
    seeds = random.sample(range(1 << 20), 6)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_PERSON_TOKENS, response_format=PERSON,
                             ignore_eos=i % 2 == 1) for i, s in enumerate(seeds)]   # ignore_eos: still ends
    outs = llm.generate([_prompt(llm) for _ in seeds], params)
    stops = set(llm.model_config.eos_token_ids)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] in stops, c
        _check_person(c.text)              # the stop token's text is not in it
        assert c.text == llm.tokenizer.decode(c.token_ids[:-1])
        matcher = _matcher(llm, PERSON)
        assert all(matcher.accept(t) for t in c.token_ids) and matcher.terminated


def test_json_object_outputs_are_objects(llm):
    seeds = random.sample(range(1 << 20), 16)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, response_format=OBJECT) for s in seeds]
    outs = [o.outputs[0] for o in llm.generate([_prompt(llm) for _ in seeds], params)]
    for c in outs:   # random weights write long strings: an unfinished output is a grammatical prefix
        matcher = _matcher(llm, OBJECT)
        assert all(matcher.accept(t) for t in c.token_ids), c
        if c.finish_reason == "stop":
            assert matcher.terminated and isinstance(json.loads(c.text), dict), c.text
        else:
            assert c.finish_reason == "length" and len(c.token_ids) == 40 and not matcher.terminated
            assert c.text.startswith("{")
    assert sum(c.finish_reason == "stop" for c in outs) >= 2


def test_max_tokens_still_ends_with_length(llm):
    out = llm.generate(_prompt(llm), SamplingParams(temperature=1.0, seed=random.randrange(1000), max_tokens=5,
                                                    response_format=PERSON))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert '{"name": "'.startswith(out.text) or out.text.startswith('{"name": "'), out.text


def test_seeded_and_greedy_constrained_requests_repeat(llm):
    prompt, seed = _prompt(llm), random.randrange(1 << 20)
    for params in (SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=seed, max_tokens=MAX_PERSON_TOKENS,
                                  response_format=PERSON),
                   SamplingParams(temperature=0, max_tokens=MAX_PERSON_TOKENS, response_format=PERSON)):
        a, b = (llm.generate(prompt, params)[0].outputs[0] for _ in range(2))
        assert a.token_ids == b.token_ids and a.finish_reason == "stop"
        _check_person(a.text)


def test_unconstrained_request_in_the_same_batch_is_unaffected(llm):
    free, constrained = _prompt(llm, 10), _prompt(llm)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(free, greedy)[0].outputs[0].token_ids
    text_seed = random.randrange(1000)
    as_text = SamplingParams(temperature=1.0, seed=text_seed, max_tokens=MAX_PERSON_TOKENS,
                             response_format={"type": "text"})
    unconstrained = llm.generate(constrained, SamplingParams(temperature=1.0, seed=text_seed,
                                                             max_tokens=MAX_PERSON_TOKENS))[0].outputs[0]
    outs = llm.generate([constrained, free, constrained],
                        [SamplingParams(temperature=1.0, seed=random.randrange(1000), max_tokens=MAX_PERSON_TOKENS,
                                        response_format=PERSON), greedy, as_text])
    assert outs[1].outputs[0].token_ids == alone
    _check_person(outs[0].outputs[0].text)
    # "text" is no constraint: the same tokens as the same seed with no response_format (it may end on EOS)
    assert outs[2].outputs[0].token_ids == unconstrained.token_ids


def test_choices_of_one_prompt_each_follow_their_own_grammar(llm):
    """Same prompt: later choices fork the first's KV and sample their first token from its stored
    prefill logits, which the masking must leave as they were."""
    prompt = _prompt(llm)
    seeds = random.sample(range(1 << 20), 3)
    results = llm.generate([prompt] * 3, [SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_PERSON_TOKENS,
                                                         logprobs=2, response_format=PERSON) for s in seeds])
    assert any(r.metrics.prefill_stats.shared_prefill for r in results[1:])
    outs = [r.outputs[0] for r in results]
    for c in outs:
        assert c.finish_reason == "stop"
        _check_person(c.text)
    first = [c.logprobs[0] for c in outs]
    assert first[0] == pytest.approx(first[1], abs=1e-5) and first[0] == pytest.approx(first[2], abs=1e-5)


def test_logprobs_are_the_unconstrained_models(llm):
    prompt = _prompt(llm)
    out = llm.generate(prompt, SamplingParams(temperature=1.0, seed=random.randrange(1000), logprobs=3,
                                              max_tokens=MAX_PERSON_TOKENS, response_format=PERSON))[0].outputs[0]
    tokens = out.token_ids
    assert len(out.logprobs) == len(tokens)
    # the first token can only be "{", yet its logprob is the model's (not 0) and the top 3 are the model's
    brace = llm.tokenizer.encode("{")[-1]
    assert tokens[0] == brace and out.logprobs[0][brace] < -0.5 and len(out.logprobs[0]) == 4
    for k in sorted({0, 1, len(tokens) // 2, len(tokens) - 1}):
        logp = torch.log_softmax(llm.next_token_logits(prompt + tokens[:k]), dim=-1)
        for token, value in out.logprobs[k].items():
            assert value == pytest.approx(logp[token].item(), abs=1e-3), (k, token)
        assert sorted(out.logprobs[k].values(), reverse=True)[:3] == pytest.approx(logp.topk(3).values.tolist(),
                                                                                  abs=1e-3)


BAD = [
    ("json", "must be an object"),
    ({"type": "xml"}, "not supported"),
    ({"json_schema": {"schema": SCHEMA}}, "not supported"),
    ({"type": "json_schema"}, "needs a 'json_schema' object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "has no 'schema'"),
    ({"type": "json_schema", "json_schema": {"schema": "{}"}}, "must be a JSON Schema object"),
    ({"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}, "strict must be a bool"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "integer", "minimum": 5, "maximum": 1}}},
     "minimum greater than maximum"),
    ({"type": "json_schema", "json_schema": {"schema": {"$ref": "#/$defs/nowhere"}}}, "cannot be compiled"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(ab"}}}, "cannot be compiled"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "no-such-type"}}}, "cannot be compiled"),
]


def test_bad_response_formats_are_refused_before_any_work(llm):
    prompt = _prompt(llm)
    for bad, words in BAD:
        with pytest.raises(InvalidRequestError, match=words) as e:
            SamplingParams(response_format=bad)
        assert e.value.param == "response_format"
        params = SamplingParams(max_tokens=4)
        params.response_format = bad          # changed after it was built: LLM checks again
        with pytest.raises(InvalidRequestError, match=words) as e:
            llm.generate([prompt, prompt], [SamplingParams(max_tokens=4), params])
        assert e.value.param == "response_format"
        with pytest.raises(InvalidRequestError, match=words):
            llm.submit(prompt, params)
    assert not llm._results and not llm._queues           # nothing was submitted
    assert llm.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].finish_reason == "length"


def test_specs_and_the_compiled_grammar_cache(llm, tmp_path):
    assert parse_response_format(None) is None and parse_response_format({"type": "text"}) is None
    reordered = {"type": "json_schema", "json_schema": {"strict": False, "schema": json.loads(json.dumps(SCHEMA)),
                                                        "name": "other"}}
    assert parse_response_format(reordered) == parse_response_format(PERSON)     # name/strict: not the grammar
    source = tokenizer_source(llm.engine.model, llm.engine.is_preset, llm.model_config.vocab_size,
                              llm.model_config.eos_token_ids, llm.tokenizer.eos_token_id)
    backend = GrammarBackend(source, llm.tokenizer)
    for rf in (PERSON, reordered, OBJECT, PERSON, OBJECT):
        backend.matcher(parse_response_format(rf))
    assert backend.compiles == 2
    with pytest.raises(InvalidRequestError, match="no tokenizer files") as e:
        check_tokenizer(tokenizer_source(str(tmp_path), False, 320, [2], None), NoTokenizer(str(tmp_path)))
    assert e.value.param == "response_format"
