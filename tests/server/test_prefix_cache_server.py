"""The prefix cache where users see it: usage.prompt_tokens_details.cached_tokens (OpenAI's field) in
completions and chat responses, and burstserve:prefix_cache_queries / _hits on /metrics; a second
question about the same document answers as transformers does."""
import random
import time

import pytest

from hf_reference import hf_next_logits_and_greedy, save_checkpoint, save_tokenizer
from burstserve.clients.server_process import RemoteServer
from live import metrics


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("served-prefix"))
    model = save_checkpoint("llama3-gqa", path, seed=random.randrange(1 << 30))
    save_tokenizer(path)
    srv = RemoteServer(["--model", path, "--served-model-name", "m", "--devices", "cpu", "-cp", "2",
                        "--dtype", "float32", "--max-model-len", "1024", "--kv-cache-tokens", "4096",
                        "--enable-prefix-caching"])
    yield srv, model
    srv.stop()


def test_cached_tokens_reported_and_answers_exact(served):
    srv, model = served
    client = srv.client()
    doc = [random.randrange(2, 320) for _ in range(300)]
    first = client.completions.create(model="m", prompt=doc, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    question = doc + [random.randrange(2, 320) for _ in range(20)]
    second = client.completions.create(model="m", prompt=question, max_tokens=6, temperature=0,
                                       extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
                                       logprobs=0)   # the reference never stops at EOS (a random model may pick it)
    assert second.usage.prompt_tokens_details.cached_tokens >= len(doc)
    _, ref_tokens = hf_next_logits_and_greedy(model, question, 6)
    assert [int(t.split(":")[1]) for t in second.choices[0].logprobs.tokens] == ref_tokens
    deadline = time.time() + 10                     # worker 0 publishes its counts a moment later
    while metrics(srv).get("burstserve:prefix_cache_hits_total{}", 0) < len(doc) and time.time() < deadline:
        time.sleep(0.1)
    values = metrics(srv)
    assert values["burstserve:prefix_cache_hits_total{}"] >= len(doc)
    assert values["burstserve:prefix_cache_queries_total{}"] >= len(doc) + len(question)


def test_chat_reports_cached_tokens(served):
    srv, _ = served
    messages = [{"role": "user", "content": "a long shared system text " * 20}]
    client = srv.client()
    client.chat.completions.create(model="m", messages=messages, max_tokens=3, temperature=0)
    again = client.chat.completions.create(model="m", messages=messages + [
        {"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}], max_tokens=3, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
