"""OpenAI compatibility, one test per case: chat roles and content, tools, logit_bias, max_completion_tokens,
model routes, logprobs naming, text offsets, stop-string metrics, the OpenAPI document, response_format and
the server's logs. Two live servers: a transformers checkpoint whose tokenizer names every token with plain
ASCII text (exact token texts and offsets), and the `tiny` preset (byte tokenizer: ids 0-255 are bytes, so
ids 242 and 255 both decode alone to U+FFFD) with the log at info and stats every second."""
import json
import re
import time

import httpx
import openai
import pytest

from live import (DEVICE_ARGS, KEY, LiveServer, ascii_checkpoint, delta, openai_error, param_names,
                  printable_window, sse_payloads, wait_until_idle)

NAME = "test-model"
MAX_LEN = 512
C, H = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("compat"))
    ascii_checkpoint(path, seed=1234)
    return path


@pytest.fixture(scope="module")
def server(checkpoint):
    srv = LiveServer(["--model", checkpoint, "--served-model-name", NAME, *DEVICE_ARGS, "--dtype", "float32",
                      "--max-model-len", str(MAX_LEN), "--kv-cache-tokens", "4096"], api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def tiny():
    """The tiny preset, no chat template, log at info with a stats line every second."""
    srv = LiveServer(["--model", "tiny", *DEVICE_ARGS, "--dtype", "float32", "--max-model-len", "1024",
                      "--kv-cache-tokens", "8192", "--log-stats-interval", "1"], api_key=KEY, log_level="info")
    yield srv
    srv.stop()


def _chat(srv, **body) -> httpx.Response:
    return srv.post(H, {"model": NAME, "messages": MSG, "max_tokens": 4, **body})


def _complete(srv, **body) -> httpx.Response:
    return srv.post(C, {"model": NAME, "prompt": "hello", "max_tokens": 4, **body})


def _ok(r: httpx.Response) -> dict:
    assert r.status_code == 200, r.text[:500]
    return r.json()


# ---- 1. chat roles and content --------------------------------------------------------------------------------
def test_chat_roles_and_content(server):
    err = openai_error(_chat(server, messages=[{"role": "wizard", "content": "hi"}]), 400)
    assert param_names(err["param"], "messages"), err
    for role in ("system", "developer", "user", "assistant"):
        _ok(_chat(server, messages=[{"role": role, "content": "hi"}, *MSG]))
    _ok(_chat(server, messages=[{"role": "system", "content": "be brief"}, {"role": "developer", "content": "ok"},
                                {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                                {"role": "user", "content": "more"}]))
    err = openai_error(_chat(server, messages=[{"role": "user"}]), 400)
    assert param_names(err["param"], "messages"), err
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True, return_tokens_as_token_ids=True)
    as_text = _ok(_chat(server, messages=[{"role": "user", "content": "the rain in spain"}], **greedy))
    as_parts = _ok(_chat(server, messages=[{"role": "user", "content": [
        {"type": "text", "text": "the rain "}, {"type": "text", "text": "in spain"}]}], **greedy))
    # the same prompt: the same usage, but the second finds all of it but its last token in the prefix cache
    parts_cached = as_parts["usage"].pop("prompt_tokens_details")["cached_tokens"]
    assert as_text["usage"].pop("prompt_tokens_details")["cached_tokens"] == 0
    assert as_parts["usage"] == as_text["usage"] and parts_cached == as_text["usage"]["prompt_tokens"] - 1

    def tokens(out):
        return [entry["token"] for entry in out["choices"][0]["logprobs"]["content"]]
    assert tokens(as_parts) == tokens(as_text) and len(tokens(as_text)) == 12
    assert as_parts["choices"][0]["message"]["content"] == as_text["choices"][0]["message"]["content"]


# ---- 2. tools ---------------------------------------------------------------------------------------------
def test_tools_are_refused_and_tool_choice_none_is_accepted(server):
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    openai_error(_chat(server, tools=[tool]), 400, param="tools")
    openai_error(_chat(server, tool_choice="required"), 400, param="tool_choice")
    _ok(_chat(server, tool_choice="none"))
    _ok(_chat(server, tools=[], tool_choice="none"))


def test_an_unknown_field_and_a_fifth_stop_string_are_refused_by_name(server):
    """As OpenAI's API: a field it does not know is a 400 naming it (ignored, another server's repetition_penalty
    would change the answer silently), and at most 4 stop strings; OpenAI's service fields are taken."""
    for make in (_complete, _chat):
        refused = openai_error(make(server, repetition_penalty=1.1), 400, param="repetition_penalty")
        assert "not a field this server takes" in refused["message"], refused
        openai_error(make(server, stop=["a", "b", "c", "d", "e"]), 400, param="stop")
        _ok(make(server, stop=["a", "b", "c", "d"], max_tokens=2))
    _ok(_chat(server, metadata={"team": "x"}, store=False, service_tier="auto", max_tokens=2))


# ---- 3. logit_bias ------------------------------------------------------------------------------------------
def test_empty_logit_bias_is_no_bias_and_a_bias_is_refused(server):
    greedy = dict(temperature=0, max_tokens=8, ignore_eos=True)
    plain = _ok(_complete(server, **greedy))["choices"][0]["text"]
    assert _ok(_complete(server, logit_bias={}, **greedy))["choices"][0]["text"] == plain
    plain_chat = _ok(_chat(server, **greedy))["choices"][0]["message"]["content"]
    assert _ok(_chat(server, logit_bias={}, **greedy))["choices"][0]["message"]["content"] == plain_chat
    openai_error(_complete(server, logit_bias={"5": 10}), 400, param="logit_bias")
    openai_error(_chat(server, logit_bias={"5": 10}), 400, param="logit_bias")


# ---- 4. max_completion_tokens ---------------------------------------------------------------------------------
def test_max_completion_tokens_is_named_in_its_errors_and_bounds_the_answer(server):
    r = server.post(H, {"model": NAME, "messages": MSG, "max_completion_tokens": 0})
    err = openai_error(r, 400)
    assert err["param"] == "max_completion_tokens", err
    assert "max_completion_tokens" in err["message"] and "max_tokens" not in err["message"], err["message"]
    out = _ok(server.post(H, {"model": NAME, "messages": MSG, "max_completion_tokens": 3, "temperature": 0}))
    assert 1 <= out["usage"]["completion_tokens"] <= 3
    out = server.client().chat.completions.create(model=NAME, messages=MSG, max_completion_tokens=3,
                                                  extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


# ---- 5. models and routes -----------------------------------------------------------------------------------
def test_unknown_model_and_routes_are_404_and_a_model_can_be_retrieved(server):
    openai_error(_complete(server, model="nope"), 404, code="model_not_found")
    openai_error(_chat(server, model="nope"), 404, code="model_not_found")
    client = server.client()
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="nope", prompt="hi", max_tokens=1)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG, max_tokens=1)
    openai_error(server.get("/v1/nope"), 404)
    model = _ok(server.get(f"/v1/models/{NAME}"))
    assert model["id"] == NAME and model["object"] == "model" and isinstance(model["owned_by"], str)
    assert client.models.retrieve(NAME).id == NAME
    openai_error(server.get("/v1/models/other"), 404, code="model_not_found")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


# ---- 6. logprobs: the sampled token is among the top, no two tokens share a name ----------------------------------
def _loads_keeping_duplicates(text: str):
    """JSON with every object's repeated keys recorded (a plain parse keeps only the last)."""
    repeated = []

    def pairs(items):
        keys = [k for k, _ in items]
        if len(set(keys)) != len(keys):
            repeated.append(keys)
        return dict(items)
    return json.loads(text, object_pairs_hook=pairs), repeated


def test_logprobs_name_every_token_apart_and_contain_the_sampled_one(tiny, figures):
    positions, problems = 0, []
    runs = [dict(temperature=1.0, seed=seed) for seed in (0, 1, 2, 3)] + [dict(temperature=0)]
    for i, sampling in enumerate(runs):
        r = tiny.post(C, {"model": "tiny", "prompt": [256, 72, 105, 200 + i, 250], "max_tokens": 64, "logprobs": 3,
                          "ignore_eos": True, **sampling})
        assert r.status_code == 200, r.text[:500]
        out, repeated = _loads_keeping_duplicates(r.text)
        if repeated:
            problems.append(f"{sampling}: repeated keys in the JSON, e.g. {repeated[0]}")
        lp = out["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 64
        for p, (token, logprob, top) in enumerate(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])):
            positions += 1
            if not 3 <= len(top) <= 4:
                problems.append(f"{sampling} position {p}: {len(top)} top entries {top} (3 + the sampled one expected)")
            elif token not in top:
                problems.append(f"{sampling} position {p}: sampled {token!r} not among the top {list(top)}")
            elif top[token] != logprob:
                problems.append(f"{sampling} position {p}: top[{token!r}] = {top[token]}, token_logprobs {logprob}")
    figures(f"openai-compat: completions logprobs=3 on tiny's byte tokenizer: {positions} positions (4 seeds at "
            f"temperature 1 and greedy), {positions - len(problems)} with the sampled token among 3-4 distinct names")
    assert not problems, f"{len(problems)} of {positions} positions wrong:\n" + "\n".join(problems[:20])


# ---- 7. text_offset ------------------------------------------------------------------------------------------
def _offsets_problem(lp: dict, text: str, start: int = 0) -> str | None:
    tokens, offsets = lp["tokens"], lp["text_offset"]
    if len(offsets) != len(tokens):
        return f"{len(offsets)} offsets for {len(tokens)} tokens"
    if offsets and offsets[0] != start:
        return f"text_offset[0] = {offsets[0]}, not {start}"
    for i in range(len(tokens) - 1):
        if offsets[i + 1] != offsets[i] + len(tokens[i]):
            return (f"text_offset[{i + 1}] = {offsets[i + 1]}, not {offsets[i]} + len({tokens[i]!r}) "
                    f"(offsets {offsets[:i + 2]}, tokens {tokens[:i + 2]})")
    if "".join(tokens) != text[start:]:
        return f"the tokens {tokens} do not spell the text {text[start:]!r}"
    return None


def test_text_offsets_follow_the_token_texts(server):
    prompt = "the quick brown fox"
    base = {"model": NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    problems = {}
    plain = _ok(server.post(C, base))["choices"][0]
    problems["plain"] = _offsets_problem(plain["logprobs"], plain["text"])
    held = _ok(server.post(C, {**base, "stop": ["\t\t\t"]}))["choices"][0]   # never matches; text is held back
    assert held["text"] == plain["text"]
    problems["with a stop string held back"] = _offsets_problem(held["logprobs"], held["text"])
    echo = _ok(server.post(C, {**base, "echo": True}))["choices"][0]
    assert echo["text"] == prompt + plain["text"]
    problems["echo"] = _offsets_problem(echo["logprobs"], echo["text"])
    prompt_tokens = len(echo["logprobs"]["tokens"]) - 24
    generated = {k: v[prompt_tokens:] for k, v in echo["logprobs"].items()}
    problems["echo, the generated part"] = _offsets_problem(generated, echo["text"], start=len(prompt))
    with httpx.stream("POST", server.url(C), headers=server.headers, timeout=60,
                      json={**base, "stream": True}) as r:
        chunks = [p for p in sse_payloads(r.iter_lines()) if p != "[DONE]" and p.get("choices")]
    streamed = {k: [x for c in chunks for x in (c["choices"][0]["logprobs"] or {}).get(k, [])]
                for k in ("tokens", "text_offset")}
    problems["streamed"] = _offsets_problem(streamed, "".join(c["choices"][0]["text"] for c in chunks))
    problems = {k: v for k, v in problems.items() if v}
    assert not problems, problems


# ---- 8. a request ended by a stop string is counted ----------------------------------------------------------------
def test_stop_string_requests_are_counted_in_the_metrics(server):
    kw = {"model": NAME, "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    for prompt in ("hello", "the quick brown fox", "a", "stop here"):
        full = _ok(server.post(C, {**kw, "prompt": prompt}))["choices"][0]["text"]
        stop = printable_window(full)
        if stop:
            break
    assert stop, f"no printable two-character window in four greedy texts (last {full!r})"
    success = 'burstserve:request_success_total{"finished_reason": "stop"}'
    e2e = "burstserve:e2e_request_latency_seconds_count{}"
    for stream in (False, True):
        before = wait_until_idle(server)
        body = {**kw, "prompt": prompt, "stop": [stop], "stream": stream}
        if stream:
            with httpx.stream("POST", server.url(C), headers=server.headers, timeout=60, json=body) as r:
                payloads = sse_payloads(r.iter_lines())
            assert payloads[-2]["choices"][0]["finish_reason"] == "stop", payloads[-2:]
        else:
            out = _ok(server.post(C, body))["choices"][0]
            assert out["finish_reason"] == "stop" and out["text"] == full[:full.index(stop)]
        after = wait_until_idle(server)
        counted = (delta(after, before, success), delta(after, before, e2e))
        assert counted == (1, 1), f"stream={stream}: request_success{{stop}} and e2e count moved by {counted}"


# ---- 9. the OpenAPI document --------------------------------------------------------------------------------
def _document(server) -> dict:
    return _ok(server.get("/openapi.json"))


def test_openapi_documents_400_and_no_422(server):
    doc = _document(server)
    documented_422 = [f"{m.upper()} {p}" for p, ops in doc["paths"].items() for m, op in ops.items()
                      if "422" in op.get("responses", {})]
    assert not documented_422, f"422 documented (the server answers 400): {documented_422}"
    assert "HTTPValidationError" not in doc.get("components", {}).get("schemas", {})
    for path in (C, H):
        assert "400" in doc["paths"][path]["post"]["responses"], doc["paths"][path]["post"]["responses"].keys()


def _media_type(r: httpx.Response) -> str | None:
    value = r.headers.get("content-type")
    return value.split(";")[0].strip() if value else None


def test_health_and_metrics_answer_what_the_schema_says(server):
    doc = _document(server)
    for path in ("/health", "/metrics"):
        r = server.get(path)
        documented = doc["paths"][path]["get"]["responses"].get(str(r.status_code))
        assert documented is not None, f"{path}: {r.status_code} not documented"
        content = documented.get("content") or {}
        if r.content:
            assert _media_type(r) in content, f"{path}: answered {_media_type(r)}, documented {list(content)}"
        else:
            assert not content, f"{path}: answered no body, documented {list(content)}"


def test_openapi_documents_the_streaming_responses(server):
    doc = _document(server)
    for path in (C, H):
        content = doc["paths"][path]["post"]["responses"]["200"].get("content", {})
        assert {"application/json", "text/event-stream"} <= set(content), f"{path}: 200 documents {list(content)}"


# ---- 10. response_format ---------------------------------------------------------------------------------------
def test_response_format_json_object(tiny, figures):
    finished = []
    for seed in range(4):
        out = _ok(tiny.post(H, {"model": "tiny", "messages": [{"role": "user", "content": "give me JSON"}],
                                "response_format": {"type": "json_object"}, "temperature": 1.0, "seed": seed,
                                "max_tokens": 200}))["choices"][0]
        if out["finish_reason"] == "stop":
            value = json.loads(out["message"]["content"])
            assert isinstance(value, dict), out["message"]["content"]
            finished.append(seed)
    figures(f"openai-compat: response_format json_object on tiny at temperature 1: {len(finished)}/4 seeds ended "
            f"within 200 tokens, each a JSON object")
    assert finished, "no seed ended with finish_reason stop within 200 tokens"


def test_response_format_json_schema(tiny):
    schema = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
              "required": ["answer"], "additionalProperties": False}
    for seed in range(3):
        out = _ok(tiny.post(H, {"model": "tiny", "messages": [{"role": "user", "content": "yes or no?"}],
                                "response_format": {"type": "json_schema",
                                                    "json_schema": {"name": "answer", "schema": schema}},
                                "temperature": 1.0, "seed": seed, "max_tokens": 200}))["choices"][0]
        assert out["finish_reason"] == "stop", out
        value = json.loads(out["message"]["content"])
        assert isinstance(value, dict) and set(value) == {"answer"} and value["answer"] in ("yes", "no"), value


# ---- 11. the server's log ---------------------------------------------------------------------------------------
REQUEST_LINE = {   # what a per-request line says, besides the request's id (loose, case-insensitive)
    "prompt tokens": r"(\d+) prompt tokens|prompt[_ ]tokens[=: ]+(\d+)",
    "TTFT": r"\bTTFT\b|time to first token",
    "output tokens": r"(\d+) (?:output|completion|generated) tokens|(?:output|completion|generated)[_ ]tokens[=: ]+(\d+)",
}
STATS_LINE = [r"prompt throughput", r"generation throughput", r"running", r"waiting", r"KV"]


def _wait_for_log(srv, pattern: str, seconds: float = 5) -> list[str]:
    deadline = time.time() + seconds
    while True:
        lines = [line for line in srv.log().splitlines() if re.search(pattern, line, re.I)]
        if lines or time.time() > deadline:
            return lines
        time.sleep(0.1)


def _number(pattern: str, line: str) -> int | None:
    m = re.search(pattern, line, re.I)
    return next((int(g) for g in m.groups() if g is not None), None) if m and m.groups() else None


def test_each_request_is_logged_with_its_id_tokens_and_ttft(tiny):
    out = _ok(tiny.post(C, {"model": "tiny", "prompt": "hello log", "max_tokens": 5, "ignore_eos": True}))
    lines = _wait_for_log(tiny, re.escape(out["id"]))
    assert lines, f"no log line names the request {out['id']}; log tail:\n{tiny.log()[-1500:]}"
    line = lines[-1]
    for what, pattern in REQUEST_LINE.items():
        assert re.search(pattern, line, re.I), f"the request's line does not give {what}: {line}"
    assert _number(REQUEST_LINE["prompt tokens"], line) == out["usage"]["prompt_tokens"], line
    assert _number(REQUEST_LINE["output tokens"], line) == out["usage"]["completion_tokens"], line


def test_the_request_line_splits_the_ttft_into_parts_that_add_up(tiny):
    """A streamed token-id prompt (fresh random ids): its line's TTFT (headers in -> token on the event loop)
    is read + checks + engine + back, engine holds the workers' queued and prefill, and the client, whose
    wait encloses the server's, saw at least that TTFT."""
    import random
    from burstserve.server.timeline import PARTS_PATTERN
    prompt = [random.randrange(320) for _ in range(random.randrange(200, 600))]
    sent = time.perf_counter()
    with httpx.stream("POST", tiny.url(C), headers=tiny.headers, timeout=60,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": 3, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        client_ttft_ms = (time.perf_counter() - sent) * 1e3
        list(lines)
    line = _wait_for_log(tiny, re.escape(json.loads(first[6:])["id"]))[-1]
    m = PARTS_PATTERN.search(line)
    assert m and m.group("queued") is not None, line
    p = {k: float(v) for k, v in m.groupdict().items()}
    assert min(p.values()) >= 0 and p["engine"] > 0, line
    assert abs(p["read"] + p["checks"] + p["engine"] + p["back"] - p["ttft"]) <= 0.25, line   # 0.05 ms rounding each
    assert abs(p["queued"] + p["prefill"] + p["between"] - p["engine"]) <= 0.2, line   # the engine's parts add up
    assert client_ttft_ms >= p["ttft"] - 0.1, (client_ttft_ms, line)
    assert _number(REQUEST_LINE["prompt tokens"], line) == len(prompt), line


def test_disable_log_requests_logs_no_request():
    srv = LiveServer(["--model", "tiny", *DEVICE_ARGS, "--dtype", "float32", "--max-model-len", "256",
                      "--kv-cache-tokens", "2048", "--disable-log-requests"], api_key=KEY, log_level="info")
    try:
        out = _ok(srv.post(C, {"model": "tiny", "prompt": "quiet", "max_tokens": 3, "ignore_eos": True}))
        time.sleep(1)
        log = srv.log()
        assert out["id"] not in log, log[-1500:]
        assert not [line for line in log.splitlines() if re.search(REQUEST_LINE["TTFT"], line, re.I)], log[-1500:]
    finally:
        srv.stop()


def test_periodic_stats_line_while_busy(tiny):
    started = time.time()
    with httpx.stream("POST", tiny.url(C), headers=tiny.headers, timeout=60,
                      json={"model": "tiny", "prompt": "busy", "max_tokens": 700, "ignore_eos": True,
                            "stream": True}) as r:
        events = sse_payloads(r.iter_lines())
    busy_seconds = time.time() - started
    assert events[-1] == "[DONE]"
    lines = [line for line in tiny.log().splitlines() if all(re.search(p, line, re.I) for p in STATS_LINE)]
    assert busy_seconds > 1.2, f"the request lasted only {busy_seconds:.2f} s: too short to see a stats line"
    assert lines, f"no line with all of {STATS_LINE} after {busy_seconds:.1f} s busy; log tail:\n{tiny.log()[-1500:]}"
    running = [_number(r"running\D{0,12}?(\d+)|(\d+) (?:reqs?|requests?) running", line) for line in lines]
    assert any(n and n >= 1 for n in running), f"no stats line shows a running request: {lines[-3:]}"


def test_default_chat_template_is_announced_at_start(tiny):
    warnings = [line for line in tiny.log().splitlines()
                if re.search(r"WARNING", line) and re.search(r"chat template", line, re.I)]
    assert warnings and re.search(r"default", warnings[0], re.I), tiny.log()[:2000]
