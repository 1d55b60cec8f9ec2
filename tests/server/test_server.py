"""The real server (subprocess, 2 CPU workers) through the official openai client and raw HTTP."""
import asyncio
import json
import random
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
import torch

from hf_reference import hf_next_logits_and_greedy, save_checkpoint, save_tokenizer
from burstserve.clients.server_process import RemoteServer
from live import metrics, printable_window, wait_until_idle

KEY = "test-key"
MAX_LEN = 512


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("served"))
    model = save_checkpoint("llama3-gqa", path, seed=random.randrange(1 << 30))
    save_tokenizer(path)
    return path, model


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = RemoteServer(["--model", checkpoint[0], "--served-model-name", "test-model", "--devices", "cpu", "-cp", "2",
                        "--dtype", "float32", "--max-model-len", str(MAX_LEN), "--kv-cache-tokens", "4096"],
                       api_key=KEY)
    yield srv
    srv.stop()


def _prompt(n):
    return [random.randrange(2, 320) for _ in range(n)]


def test_token_prompt_greedy_matches_transformers_with_logprobs(server, checkpoint):
    prompt = _prompt(50)
    _, ref_tokens = hf_next_logits_and_greedy(checkpoint[1], prompt, 8)
    ref_logp = []
    with torch.no_grad():
        ids = torch.tensor([prompt + ref_tokens])
        logits = checkpoint[1](ids).logits[0, len(prompt) - 1:-1].float()
        ref_logp = torch.log_softmax(logits, dim=-1)
    out = server.client().completions.create(model="test-model", prompt=prompt, max_tokens=8, temperature=0,
                                             logprobs=3, extra_body={"return_tokens_as_token_ids": True,
                                                                     "ignore_eos": True})
    choice = out.choices[0]
    tokens = [int(t.split(":")[1]) for t in choice.logprobs.tokens]
    assert tokens == ref_tokens
    for i, (t, lp) in enumerate(zip(tokens, choice.logprobs.token_logprobs)):
        assert abs(lp - ref_logp[i, t].item()) < 1e-3
        assert len(choice.logprobs.top_logprobs[i]) == 3
    assert out.usage.prompt_tokens == 50 and out.usage.completion_tokens == 8 and out.usage.total_tokens == 58
    assert choice.finish_reason == "length" and out.model == "test-model"


def test_streaming_completion_ends_with_done_and_usage(server):
    stream = server.client().completions.create(model="test-model", prompt="hello world", max_tokens=6,
                                                temperature=0, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
    chunks = list(stream)
    token_chunks = [c for c in chunks if c.choices]
    assert len(token_chunks) == 6 and token_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 6
    with httpx.stream("POST", server.url("/v1/completions"), headers=server.headers,
                      json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"


def test_text_and_stream_agree(server):
    client = server.client()
    kw = dict(model="test-model", prompt="the quick brown fox", max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].text
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw))
    assert whole == streamed


def test_chat_uses_the_template_and_streams(server, checkpoint):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(checkpoint[0])
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    expected_prompt = len(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])
    client = server.client()
    out = client.chat.completions.create(model="test-model", messages=messages, max_completion_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2,
                                         extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == expected_prompt and out.usage.completion_tokens == 5
    assert len(out.choices[0].logprobs.content) == 5
    assert all(len(c.top_logprobs) == 2 for c in out.choices[0].logprobs.content)
    chunks = list(client.chat.completions.create(model="test-model", messages=messages, max_tokens=5,
                                                 temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == out.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seed_reproduces_sampling(server):
    client = server.client()
    kw = dict(model="test-model", prompt=_prompt(20), max_tokens=12, temperature=1.0, logprobs=0,
              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    a, b, c = (client.completions.create(seed=s, **kw).choices[0].logprobs.tokens for s in (3, 3, 4))
    assert a == b and a != c


def test_a_kept_alive_client_gets_the_first_token_as_the_server_sends_it(server):
    """On a kept-alive connection a stream's first token follows its response headers at once: the client's
    time to first token is within 20 ms of the server's own (its TTFT histogram over the same requests).
    Without TCP_NODELAY on the accepted socket (server/cli.py listening_socket), Nagle's algorithm held the
    token until the client's delayed ACK of the headers, about 40 ms."""
    def server_ttft() -> tuple[float, float]:
        values = metrics(server)
        return (values["burstserve:time_to_first_token_seconds_sum{}"],
                values["burstserve:time_to_first_token_seconds_count{}"])

    def first_token_seconds(client: httpx.Client) -> float:
        body = {"model": "test-model", "prompt": _prompt(16), "max_tokens": 2, "stream": True, "ignore_eos": True}
        start = time.perf_counter()
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            seconds = time.perf_counter() - start
            assert "data: [DONE]" in list(lines)
        return seconds

    with httpx.Client(base_url=server.url(""), headers=server.headers, timeout=60) as client:
        first_token_seconds(client)                                     # the connection opened, the path warm
        wait_until_idle(server)
        before = server_ttft()
        client_seconds = [first_token_seconds(client) for _ in range(9)]
    after = server_ttft()
    assert after[1] - before[1] == 9
    own = (after[0] - before[0]) / 9
    gap = sorted(client_seconds)[4] - own
    print(f"client TTFT median {sorted(client_seconds)[4] * 1e3:.1f} ms, server's own {own * 1e3:.1f} ms")
    assert gap < 0.020, (client_seconds, own)


def test_stop_string_cuts_the_text(server):
    # Printable-ASCII stop strings: with invalid byte sequences (control bytes, U+FFFD) the cut text was once
    # seen one character off; that edge case of incremental detokenization is still open.
    client = server.client()
    for prompt in ("hello", "the quick brown fox", "a", "stop here", "zzz"):
        kw = dict(model="test-model", prompt=prompt, max_tokens=120, temperature=0, extra_body={"ignore_eos": True})
        full = client.completions.create(**kw).choices[0].text
        stop = printable_window(full)
        if stop:
            break
    assert stop, f"no printable two-character window in five greedy texts (last {full!r})"
    cut = client.completions.create(stop=[stop], **kw).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **kw))
    assert streamed == cut.text


def test_several_prompts_in_one_request(server):
    out = server.client().completions.create(model="test-model", prompt=[_prompt(5), _prompt(9)], max_tokens=3,
                                             temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert out.usage.prompt_tokens == 14 and out.usage.completion_tokens == 6


def test_n_choices_share_the_prefill_and_sample_like_single_requests(server):
    client = server.client()
    prompts = [_prompt(30), _prompt(41)]
    kw = dict(model="test-model", max_tokens=12, temperature=1.0, logprobs=0,
              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    before = wait_until_idle(server)
    out = client.completions.create(prompt=prompts, n=3, seed=11, **kw)
    after = wait_until_idle(server)
    assert [c.index for c in sorted(out.choices, key=lambda c: c.index)] == list(range(6))
    assert out.usage.prompt_tokens == 71 and out.usage.completion_tokens == 6 * 12
    prefills = 'burstserve:request_prefill_time_seconds_count{}'
    assert after[prefills] - before.get(prefills, 0) == 2   # one prefill per prompt, not per choice
    prefilled = 'burstserve:prompt_tokens_total{}'
    assert after[prefilled] - before.get(prefilled, 0) == 71
    by_index = {c.index: c.logprobs.tokens for c in out.choices}
    for i, prompt in enumerate(prompts):
        for j in range(3):   # choice j samples with seed + j, exactly as a request of its own
            alone = client.completions.create(prompt=prompt, seed=11 + j, **kw).choices[0].logprobs.tokens
            assert by_index[i * 3 + j] == alone, (i, j)
    assert len({tuple(by_index[j]) for j in range(3)}) == 3


def test_echo_with_logprobs_scores_the_prompt_like_transformers(server, checkpoint):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0 (and the same with generation)."""
    prompt = _prompt(40)
    with torch.no_grad():
        ref = torch.log_softmax(checkpoint[1](torch.tensor([prompt])).logits[0].float(), dim=-1)   # [N, V]
    body = {"model": "test-model", "prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 0, "temperature": 0,
            "return_tokens_as_token_ids": True}
    r = httpx.post(server.url("/v1/completions"), headers=server.headers, json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice, lp = out["choices"][0], out["choices"][0]["logprobs"]
    assert choice["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 0
    assert [int(t.split(":")[1]) for t in lp["tokens"]] == prompt
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for p in range(1, len(prompt)):
        assert abs(lp["token_logprobs"][p] - ref[p - 1, prompt[p]].item()) < 1e-3, p
        best = int(ref[p - 1].argmax())
        assert abs(lp["top_logprobs"][p][f"token_id:{best}"] - ref[p - 1, best].item()) < 1e-3
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    with httpx.stream("POST", server.url("/v1/completions"), headers=server.headers,
                      json={**body, "stream": True}) as r:
        streamed = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert streamed[0]["choices"][0]["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:],
                                                                                      abs=1e-5)
    assert streamed[-1]["choices"][0]["finish_reason"] == "length"
    generated = httpx.post(server.url("/v1/completions"), headers=server.headers,
                           json={**body, "max_tokens": 3, "ignore_eos": True}).json()["choices"][0]["logprobs"]
    assert len(generated["tokens"]) == 43 and generated["token_logprobs"][0] is None
    assert generated["token_logprobs"][1:len(prompt)] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)
    r = httpx.post(server.url("/v1/completions"), headers=server.headers, json={**body, "echo": False})
    assert r.status_code == 200     # max_tokens 0 without echo: nothing to return, as OpenAI's legacy API
    choice = r.json()["choices"][0]
    assert choice["text"] == "" and choice["finish_reason"] == "length" and r.json()["usage"]["completion_tokens"] == 0


def test_chat_n_streams_every_choice(server):
    client = server.client()
    kw = dict(model="test-model", messages=[{"role": "user", "content": "hello there"}], max_tokens=6,
              temperature=0, n=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    assert sorted(c.index for c in whole.choices) == [0, 1]
    assert whole.choices[0].message.content == whole.choices[1].message.content   # greedy: the same text
    assert whole.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(stream=True, **kw))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == "length"
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[i].message.content


def test_32_concurrent_streams_complete(server):
    async def one(client, i):
        n = 4 + i % 7
        stream = await client.completions.create(model="test-model", prompt=_prompt(10 + i), max_tokens=n,
                                                 temperature=0.7, seed=i, stream=True,
                                                 extra_body={"ignore_eos": True})
        count = 0
        async for chunk in stream:
            count += len(chunk.choices)
        return count, n

    async def run():
        client = server.async_client()
        return await asyncio.gather(*(one(client, i) for i in range(32)))
    for got, want in asyncio.run(run()):
        assert got == want


def test_disconnect_frees_kv_and_metrics_move(server):
    before = metrics(server)
    with httpx.stream("POST", server.url("/v1/completions"), headers=server.headers, timeout=60,
                      json={"prompt": _prompt(300), "max_tokens": 200, "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
        during = metrics(server)
    usage_during = [v for k, v in during.items() if k.startswith("burstserve:kv_cache_usage_perc")]
    assert sum(usage_during) > 0 and during['burstserve:num_requests_running{}'] >= 1
    after = wait_until_idle(server)
    assert after['burstserve:prompt_tokens_total{}'] >= before.get('burstserve:prompt_tokens_total{}', 0) + 300
    assert after['burstserve:time_to_first_token_seconds_count{}'] > before.get(
        'burstserve:time_to_first_token_seconds_count{}', 0)
    assert after['burstserve:ring_exchange_hidden_fraction_count{}'] >= 1
    assert after['burstserve:request_prefill_time_seconds_count{}'] >= 1


@pytest.mark.parametrize("body,param", [
    ({"prompt": "hi", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "n": 65}, "n"),
    ({"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": [1, 2, 100000]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
])
def test_invalid_parameters_get_400(server, body, param):
    r = httpx.post(server.url("/v1/completions"), headers=server.headers, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_context_overflow_is_worded_like_vllm(server):
    r = httpx.post(server.url("/v1/completions"), headers=server.headers,
                   json={"prompt": _prompt(500), "max_tokens": 20})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        f"This model's maximum context length is {MAX_LEN} tokens. However, you requested 520 tokens")


def test_malformed_bodies(server):
    """Each gets a 400 that says what to send: invalid JSON; a JSON body without a JSON Content-Type (none, or
    curl -d's form type) names the header; JSON that is not an object says so."""
    json_type = {**server.headers, "content-type": "application/json"}
    r = httpx.post(server.url("/v1/completions"), headers=json_type, content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body is not valid JSON"
    body = json.dumps({"model": "test-model", "prompt": "hi", "max_tokens": 1}).encode()
    for kind in (None, "application/x-www-form-urlencoded", "text/plain"):
        headers = server.headers if kind is None else {**server.headers, "content-type": kind}
        r = httpx.post(server.url("/v1/completions"), headers=headers, content=body)
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "`Content-Type: application/json`" in message, message
        assert f"this request's Content-Type: {kind or 'none'}" in message, message
    r = httpx.post(server.url("/v1/completions"), headers=json_type, content=b"[1, 2]")
    assert r.status_code == 400 and r.json()["error"]["message"] == "the request body must be a JSON object of " \
                                                                    "the request's fields"
    assert httpx.post(server.url("/v1/completions"), headers=json_type, content=body).status_code == 200


def test_unknown_model_is_404(server):
    """OpenAI's 404, and its message names the model this server serves."""
    with pytest.raises(openai.NotFoundError) as refused:
        server.client().completions.create(model="nope", prompt="hi", max_tokens=1)
    error = refused.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model", error
    assert "`nope` does not exist" in error["message"] and "serves `test-model`" in error["message"], error


def test_api_key_is_required(server):
    assert httpx.post(server.url("/v1/completions"), json={"prompt": "hi"}).status_code == 401
    r = httpx.post(server.url("/v1/completions"), headers={"Authorization": "Bearer wrong"}, json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.url("/health")).status_code == 200


def test_models_endpoint(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["test-model"]


def test_server_stays_healthy_after_bad_input(server):
    assert httpx.get(server.url("/health")).status_code == 200
    out = server.client().completions.create(model="test-model", prompt="ok", max_tokens=2)
    assert out.usage.completion_tokens >= 1


@pytest.fixture(scope="module")
def small_server(checkpoint):
    srv = RemoteServer(["--model", checkpoint[0], "--devices", "cpu", "-cp", "2", "--dtype", "float32",
                        "--max-waiting", "1", "--max-request-body-bytes", "20000"])
    yield srv
    srv.stop()


def test_body_over_limit_is_413(small_server):
    r = httpx.post(small_server.url("/v1/completions"), json={"prompt": "x" * 30000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_full_queue_is_429_with_retry_after(small_server):
    async def one(client):
        return await client.post(small_server.url("/v1/completions"),   # long prompts: prefills overlap arrivals
                                 json={"prompt": _prompt(3000), "max_tokens": 1}, timeout=60)

    async def run():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*(one(client) for _ in range(12)))
    responses = asyncio.run(run())
    codes = sorted(r.status_code for r in responses)
    assert 200 in codes and 429 in codes, codes
    busy = next(r for r in responses if r.status_code == 429)
    assert busy.headers["retry-after"] and busy.json()["error"]["type"] == "rate_limit_error"
    assert httpx.get(small_server.url("/health")).status_code == 200


def test_dead_engine_is_503(checkpoint):
    import subprocess
    srv = RemoteServer(["--model", checkpoint[0], "--devices", "cpu", "-cp", "2", "--dtype", "float32"])
    try:
        workers = subprocess.run(["pgrep", "-P", str(srv.proc.pid), "-f", "spawn_main"], capture_output=True, text=True).stdout.split()
        assert workers
        for pid in workers:
            subprocess.run(["kill", "-9", pid])
        deadline = time.time() + 10
        while httpx.get(srv.url("/health")).status_code != 503 and time.time() < deadline:
            time.sleep(0.2)
        assert httpx.get(srv.url("/health")).status_code == 503
        r = httpx.post(srv.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    finally:
        srv.stop()


def test_sigterm_stops_every_worker(checkpoint):
    import subprocess
    srv = RemoteServer(["--model", checkpoint[0], "--devices", "cpu", "-cp", "3", "--dtype", "float32"])
    workers = subprocess.run(["pgrep", "-P", str(srv.proc.pid), "-f", "spawn_main"], capture_output=True,
                             text=True).stdout.split()
    assert len(workers) >= 3
    srv.stop()
    assert srv.proc.returncode in (0, -15)   # uvicorn re-raises SIGTERM after its graceful shutdown
    alive = [pid for pid in workers if subprocess.run(["kill", "-0", pid], capture_output=True).returncode == 0]
    assert not alive, f"workers left running: {alive}"


def test_non_streaming_disconnect_cancels_the_request(small_server):
    server = small_server      # context 4096: a generation of 4000 tokens lasts seconds, far past the disconnect
    before = metrics(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), timeout=httpx.Timeout(30, read=0.5),
                   json={"prompt": _prompt(20), "max_tokens": 4000, "ignore_eos": True})
    after = wait_until_idle(server)
    generated = after['burstserve:generation_tokens_total{}'] - before.get('burstserve:generation_tokens_total{}', 0)
    assert generated < 4000, "the request ran to its end instead of being cancelled"
    assert httpx.get(server.url("/health")).status_code == 200


def test_a_port_in_use_is_refused_before_the_model_loads():
    """serve binds its HTTP port first (as vLLM does): a port another process listens on ends serve with
    exit 2 and the address named, before any worker starts; the engine's own processes can never take it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        start = time.time()
        done = subprocess.run([sys.executable, "-m", "burstserve.server.cli", "serve", "--model", "tiny", "--devices", "cpu",
                               "-cp", "2", "--port", str(port), "--log-level", "info"],
                              capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in out and "in use" in out, out[-2000:]
    assert "KV pool" not in out and "worker 0" not in out, out[-2000:]       # refused before the engine started
    print(f"refused in {time.time() - start:.1f} s")
