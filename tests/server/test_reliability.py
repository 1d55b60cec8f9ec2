"""The reliability suite: a live CPU server (the `tiny` preset, 2 worker processes) under bad requests, a
schema fuzz, 256 concurrent streams, disconnects, a killed worker and SIGTERM. Every HTTP call and every
wait is bounded; every test records its figures (printed in the "reliability figures" section)."""
import asyncio
import copy
import json
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field

import httpx
import hypothesis
import pytest
import schemathesis

from live import (DEVICE_ARGS, KEY, TIMEOUT, LiveServer, alive, busy, cmdline, delta, descendants,
                  error_shape_problem, group_members, kill_group, metrics, openai_error, param_names, sse_payloads,
                  wait_until_idle, worker_pids)

MAX_LEN = 256            # tiny's context here: short prompts, short generations, a cheap "too long"
MODEL = "tiny"
BASE_ARGS = ["--model", MODEL, *DEVICE_ARGS, "--dtype", "float32", "--kv-cache-tokens", "16384"]


@pytest.fixture(scope="module")
def server():
    srv = LiveServer([*BASE_ARGS, "--max-model-len", str(MAX_LEN), "--max-waiting", "512"], api_key=KEY)
    yield srv
    srv.stop()


def _ids(seed: int, n: int = 8) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 256) for _ in range(n)]


# ---- A1. bad requests --------------------------------------------------------------------------------------
ANY = object()   # no expectation on param


@dataclass
class Bad:
    name: str
    path: str
    body: object = None            # JSON body (None: none)
    status: int = 400
    param: object = ANY            # the field the param names (see param_names), or ANY
    code: object = ANY             # exact code, or ANY
    raw: bytes | None = None       # raw body instead of JSON
    headers: dict = field(default_factory=dict)
    method: str = "POST"
    auth: bool = True


C, H = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
JSON_CT = {"content-type": "application/json"}
MESSAGES = "messages"

BAD_REQUESTS = [
    # /v1/completions
    Bad("malformed JSON", C, raw=b"{not json", headers=JSON_CT),
    Bad("truncated JSON", C, raw=b'{"prompt": "hi", "max_tokens": ', headers=JSON_CT),
    Bad("JSON array body", C, raw=b"[1, 2]", headers=JSON_CT),
    Bad("JSON string body", C, raw=b'"hello"', headers=JSON_CT),
    Bad("empty body", C, raw=b"", headers=JSON_CT),
    Bad("plain text body", C, raw=b"plain text"),
    Bad("invalid UTF-8 body", C, raw=b'{"prompt": "\xff\xfe"}', headers=JSON_CT),
    Bad("missing prompt", C, {"max_tokens": 3}, param="prompt"),
    Bad("prompt a number", C, {"prompt": 5}, param="prompt"),
    Bad("prompt an object", C, {"prompt": {"text": "hi"}}, param="prompt"),
    Bad("prompt null", C, {"prompt": None}, param="prompt"),
    Bad("empty token list", C, {"prompt": []}, param="prompt"),
    Bad("token id over the vocabulary", C, {"prompt": [1, 2, 100000]}, param="prompt"),
    Bad("negative token id", C, {"prompt": [1, -1]}, param="prompt"),
    Bad("token id beyond int32", C, {"prompt": [1, 2 ** 31]}, param="prompt"),
    Bad("token id beyond int64", C, {"prompt": [2 ** 70, 1]}, param="prompt"),
    Bad("mixed token list", C, {"prompt": [1, "a"]}, param="prompt"),
    Bad("a boolean among token ids", C, {"prompt": [1, True, 2]}, param="prompt"),
    Bad("a float among token ids", C, {"prompt": [1, 2.5]}, param="prompt"),
    Bad("prompt over the context", C, {"prompt": "x" * 300, "max_tokens": 1}, param="prompt",
        code="context_length_exceeded"),
    Bad("prompt + max_tokens over the context", C, {"prompt": [1, 2, 3], "max_tokens": 1000},
        code="context_length_exceeded"),
    Bad("max_tokens -1", C, {"prompt": "hi", "max_tokens": -1}, param="max_tokens"),
    Bad("max_tokens a string", C, {"prompt": "hi", "max_tokens": "ten"}, param="max_tokens"),
    Bad("max_tokens a fraction", C, {"prompt": "hi", "max_tokens": 2.5}, param="max_tokens"),
    Bad("temperature -0.1", C, {"prompt": "hi", "temperature": -0.1}, param="temperature"),
    Bad("temperature a string", C, {"prompt": "hi", "temperature": "hot"}, param="temperature"),
    Bad("top_p 0", C, {"prompt": "hi", "top_p": 0}, param="top_p"),
    Bad("top_p 1.5", C, {"prompt": "hi", "top_p": 1.5}, param="top_p"),
    Bad("top_k -2", C, {"prompt": "hi", "top_k": -2}, param="top_k"),
    Bad("n 0", C, {"prompt": "hi", "n": 0}, param="n"),
    Bad("n 65", C, {"prompt": "hi", "n": 65}, param="n"),
    Bad("huge n", C, {"prompt": "hi", "n": 100000}, param="n"),
    Bad("logprobs 21", C, {"prompt": "hi", "logprobs": 21}, param="logprobs"),
    Bad("logprobs -1", C, {"prompt": "hi", "logprobs": -1}, param="logprobs"),
    Bad("best_of != n", C, {"prompt": "hi", "n": 2, "best_of": 3}, param="best_of"),
    Bad("suffix", C, {"prompt": "hi", "suffix": "end"}, param="suffix"),
    Bad("frequency_penalty", C, {"prompt": "hi", "frequency_penalty": 0.5}, param="frequency_penalty"),
    Bad("presence_penalty", C, {"prompt": "hi", "presence_penalty": -1}, param="presence_penalty"),
    Bad("logit_bias", C, {"prompt": "hi", "logit_bias": {"5": 10}}, param="logit_bias"),
    Bad("stop list of 17", C, {"prompt": "hi", "stop": [f"s{i}" for i in range(17)]}, param="stop"),
    Bad("stop a number", C, {"prompt": "hi", "stop": 5}, param="stop"),
    Bad("stream a string", C, {"prompt": "hi", "stream": "maybe"}, param="stream"),
    Bad("seed a string", C, {"prompt": "hi", "seed": "abc"}, param="seed"),
    Bad("unknown model", C, {"model": "nope", "prompt": "hi", "max_tokens": 1}, status=404, code="model_not_found"),
    Bad("wrong API key", C, {"prompt": "hi"}, status=401, code="invalid_api_key", auth=False,
        headers={"Authorization": "Bearer wrong"}),
    Bad("missing API key", C, {"prompt": "hi"}, status=401, auth=False),
    Bad("GET /v1/completions", C, method="GET", status=405, code="method_not_allowed"),
    # /v1/chat/completions
    Bad("chat: malformed JSON", H, raw=b'{"messages": [', headers=JSON_CT),
    Bad("chat: missing messages", H, {"max_tokens": 2}, param=MESSAGES),
    Bad("chat: empty messages", H, {"messages": []}, param=MESSAGES),
    Bad("chat: messages a string", H, {"messages": "hi"}, param=MESSAGES),
    Bad("chat: message without role", H, {"messages": [{"content": "hi"}]}, param=MESSAGES),
    Bad("chat: unknown role", H, {"messages": [{"role": "wizard", "content": "hi"}]}, param=MESSAGES),
    Bad("chat: user message without content", H, {"messages": [{"role": "user"}]}, param=MESSAGES),
    Bad("chat: content a number", H, {"messages": [{"role": "user", "content": 5}]}, param=MESSAGES),
    Bad("chat: image content part", H, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}, param=MESSAGES),
    Bad("chat: tools", H, {"messages": MSG, "tools": [{"type": "function", "function": {"name": "f"}}]},
        param="tools"),
    Bad("chat: tool_choice required", H, {"messages": MSG, "tool_choice": "required"}, param="tool_choice"),
    Bad("chat: tool_choice a function", H, {"messages": MSG, "tool_choice": {
        "type": "function", "function": {"name": "f"}}}, param="tool_choice"),
    Bad("chat: functions", H, {"messages": MSG, "functions": [{"name": "f", "parameters": {}}]},
        param="functions"),
    Bad("chat: tool calls in a message", H, {"messages": [*MSG, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, param=MESSAGES),
    Bad("chat: audio content part", H, {"messages": [{"role": "user", "content": [
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}]}]}, param=MESSAGES),
    Bad("chat: logit_bias", H, {"messages": MSG, "logit_bias": {"5": 10}}, param="logit_bias"),
    Bad("chat: max_completion_tokens 0", H, {"messages": MSG, "max_completion_tokens": 0},
        param="max_completion_tokens"),
    Bad("chat: max_tokens -5", H, {"messages": MSG, "max_tokens": -5}, param="max_tokens"),
    Bad("chat: response_format of unknown type", H, {"messages": MSG, "response_format": {"type": "xml"}},
        param="response_format"),
    Bad("chat: json_schema without a schema", H, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x"}}}, param="response_format"),
    Bad("chat: temperature a string", H, {"messages": MSG, "temperature": "hot"}, param="temperature"),
    Bad("chat: top_p 2", H, {"messages": MSG, "top_p": 2}, param="top_p"),
    Bad("chat: huge n", H, {"messages": MSG, "n": 1000}, param="n"),
    Bad("chat: top_logprobs without logprobs", H, {"messages": MSG, "top_logprobs": 3}, param="top_logprobs"),
    Bad("chat: top_logprobs 21", H, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, param="top_logprobs"),
    Bad("chat: frequency_penalty", H, {"messages": MSG, "frequency_penalty": 1}, param="frequency_penalty"),
    Bad("chat: stop list of 17", H, {"messages": MSG, "stop": [f"s{i}" for i in range(17)]}, param="stop"),
    Bad("chat: prompt over the context", H, {"messages": [{"role": "user", "content": "x" * 400}]},
        code="context_length_exceeded"),
    Bad("chat: unknown model", H, {"model": "nope", "messages": MSG}, status=404, code="model_not_found"),
    Bad("chat: wrong API key", H, {"messages": MSG}, status=401, code="invalid_api_key", auth=False,
        headers={"Authorization": "Bearer wrong"}),
    Bad("GET /v1/chat/completions", H, method="GET", status=405, code="method_not_allowed"),
    # other routes
    Bad("GET /v1/nope", "/v1/nope", method="GET", status=404, code="not_found"),
    Bad("POST /v1/nope", "/v1/nope", {"prompt": "hi"}, status=404, code="not_found"),
    Bad("GET /nope", "/nope", method="GET", status=404, code="not_found"),
    Bad("DELETE /v1/models", "/v1/models", method="DELETE", status=405, code="method_not_allowed"),
    Bad("POST /health", "/health", {}, status=405, code="method_not_allowed"),
    Bad("GET /v1/models/other", "/v1/models/other", method="GET", status=404, code="model_not_found"),
]


def _send(srv, case: Bad) -> httpx.Response:
    headers = dict(srv.headers) if case.auth else {}
    headers.update(case.headers)
    kw = {"headers": headers, "timeout": TIMEOUT}
    if case.raw is not None:
        kw["content"] = case.raw
    elif case.body is not None:
        kw["json"] = case.body
    return httpx.request(case.method, srv.url(case.path), **kw)


def _problem(case: Bad, r: httpx.Response) -> str | None:
    if r.status_code >= 500:
        return f"{r.status_code} (a server error): {r.text[:300]}"
    if r.status_code != case.status:
        return f"{r.status_code}, not {case.status}: {r.text[:300]}"
    shape = error_shape_problem(r)
    if shape:
        return shape
    err = r.json()["error"]
    if case.param is not ANY and not param_names(err["param"], case.param):
        return f"param {err['param']!r} does not name {case.param!r}: {err['message']!r}"
    if case.code is not ANY and err["code"] != case.code:
        return f"code {err['code']!r}, not {case.code!r}"
    return None


def test_bad_requests_are_4xx_openai_errors_and_the_server_keeps_serving(server, figures):
    assert len({c.name for c in BAD_REQUESTS}) == len(BAD_REQUESTS) >= 40
    problems, statuses, started = [], {}, time.time()
    for case in BAD_REQUESTS:
        r = _send(server, case)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        problem = _problem(case, r)
        if problem:
            problems.append(f"{case.name} ({case.method} {case.path}): {problem}")
    seconds = time.time() - started
    assert server.get("/health").status_code == 200
    out = server.post(C, {"prompt": "ok", "max_tokens": 3, "ignore_eos": True})
    assert out.status_code == 200 and out.json()["usage"]["completion_tokens"] == 3, out.text
    chat = server.post(H, {"messages": MSG, "max_tokens": 3, "ignore_eos": True})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3, chat.text
    per_endpoint = {p: sum(c.path == p for c in BAD_REQUESTS) for p in (C, H)}
    counts = ", ".join(f"{n} x {s}" for s, n in sorted(statuses.items()))
    figures(f"reliability: {len(BAD_REQUESTS)} bad requests ({per_endpoint[C]} completions, {per_endpoint[H]} chat, "
            f"{len(BAD_REQUESTS) - sum(per_endpoint.values())} other routes) in {seconds:.1f} s: {counts}; "
            f"{len(BAD_REQUESTS) - len(problems)} as expected; /health 200 and both endpoints serving afterwards")
    assert not problems, f"{len(problems)} of {len(BAD_REQUESTS)} bad requests answered wrongly:\n" + \
        "\n".join(problems)


# ---- A2. 256 concurrent streams ---------------------------------------------------------------------------------
def _stream_body(seed: int, max_tokens: int) -> dict:
    return {"model": MODEL, "prompt": _ids(seed), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True}


async def _stream(client, srv, body, disconnect_after: int | None = None) -> dict:
    """Reads one completion stream: its token ids, usage, whether it ended with [DONE], TTFT and latency."""
    started = time.time()
    out = {"tokens": [], "done": False, "usage": None, "errors": [], "ttft": None, "status": None}
    async with client.stream("POST", srv.url(C), headers=srv.headers, timeout=TIMEOUT,
                             json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        out["status"] = r.status_code
        if r.status_code != 200:
            out["errors"].append((await r.aread()).decode(errors="replace"))
            return out
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = sse_payloads([line])[0]
            if payload == "[DONE]":
                out["done"] = True
            elif "error" in payload:
                out["errors"].append(payload)
            else:
                if payload.get("usage"):
                    out["usage"] = payload["usage"]
                for choice in payload.get("choices") or []:
                    tokens = (choice.get("logprobs") or {}).get("tokens") or []
                    out["tokens"] += [int(t.split(":")[1]) for t in tokens]
                if out["tokens"] and out["ttft"] is None:
                    out["ttft"] = time.time() - started
                if disconnect_after is not None and len(out["tokens"]) >= disconnect_after:
                    out["disconnected"] = time.time()
                    break   # leaving the block closes the connection while the request runs
    out["seconds"] = time.time() - started
    return out


def _exact(result: dict, k: int) -> str | None:
    if result["status"] != 200 or result["errors"]:
        return f"status {result['status']}, errors {result['errors'][:1]}"
    if len(result["tokens"]) != k:
        return f"{len(result['tokens'])} tokens, not {k}"
    if not result["done"]:
        return "no data: [DONE] at the end"
    if not result["usage"] or result["usage"]["completion_tokens"] != k:
        return f"usage {result['usage']}"
    return None


async def _many(srv, bodies, disconnect_after=None):
    limits = httpx.Limits(max_connections=len(bodies) + 8, max_keepalive_connections=len(bodies) + 8)
    async with httpx.AsyncClient(limits=limits) as client:
        return await asyncio.wait_for(asyncio.gather(*(
            _stream(client, srv, body, disconnect_after(i) if disconnect_after else None)
            for i, body in enumerate(bodies))), timeout=240)


def test_256_concurrent_streams_each_get_exactly_their_tokens(server, figures):
    n, k = 256, 32
    bodies = [_stream_body(1000 + i, k) for i in range(n)]
    started = time.time()
    results = asyncio.run(_many(server, bodies))
    seconds = time.time() - started
    bad = {i: p for i, r in enumerate(results) if (p := _exact(r, k))}
    alone = {}
    for i in (0, 101, 202, 255):   # the same prompt alone gives exactly the same tokens
        r = server.post(C, bodies[i])
        assert r.status_code == 200, r.text
        alone[i] = [int(t.split(":")[1]) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    differ = [i for i in alone if alone[i] != results[i]["tokens"]]
    tokens = sum(len(r["tokens"]) for r in results)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    figures(f"reliability: {n} concurrent streams x {k} tokens (tiny, max-num-seqs 64), {tokens} tokens in "
            f"{seconds:.1f} s ({tokens / seconds:.0f} tokens/s), max TTFT {max(ttfts, default=0):.2f} s, max latency "
            f"{max(r.get('seconds', 0) for r in results):.1f} s, {n - len(bad)}/{n} exact with [DONE]; "
            f"{len(alone) - len(differ)}/{len(alone)} equal to the same prompt alone")
    assert not bad, f"{len(bad)} of {n} streams wrong, e.g. {list(bad.items())[:5]}"
    assert not differ, {i: (results[i]["tokens"], alone[i]) for i in differ}
    wait_until_idle(server, 10)


# ---- A3. disconnects ------------------------------------------------------------------------------------------
def test_half_of_64_streams_disconnect_and_their_kv_is_freed(server, figures):
    n, k = 64, 128
    before = wait_until_idle(server, 10)
    bodies = [_stream_body(5000 + i, k) for i in range(n)]
    started = time.time()
    results = asyncio.run(_many(server, bodies, disconnect_after=lambda i: 1 if i % 2 else None))
    finished = time.time()
    kept = [r for i, r in enumerate(results) if i % 2 == 0]
    gone = [r for i, r in enumerate(results) if i % 2]
    bad = {i: p for i, r in enumerate(kept) if (p := _exact(r, k))}
    not_gone = [r for r in gone if "disconnected" not in r]
    deadline = time.time() + 5
    while True:   # running 0 and every worker's KV 0 within a few seconds
        values = metrics(server)
        running, kv = busy(values)
        if (running == 0 and not any(kv)) or time.time() > deadline:
            break
        time.sleep(0.05)
    idle_after = time.time() - finished
    generated = delta(values, before, "burstserve:generation_tokens_total{}")
    figures(f"reliability: {n} streams of {k} tokens, {len(gone)} disconnected after their first token: "
            f"{len(kept) - len(bad)}/{len(kept)} kept streams complete in {finished - started:.1f} s; running "
            f"{running:g} and KV {[round(x, 4) for x in kv]} {idle_after:.2f} s after the last one; "
            f"{generated:.0f} tokens generated in all ({len(kept) * k} for the kept streams, {n * k} had none been "
            f"cancelled)")
    assert not not_gone, f"{len(not_gone)} streams ended before their first token"
    assert not bad, f"{len(bad)} kept streams wrong: {list(bad.items())[:5]}"
    assert running == 0 and not any(kv), f"5 s after the streams: running {running}, KV per worker {kv}"
    assert generated < len(kept) * k + len(gone) * k / 2, \
        f"{generated} tokens generated: the disconnected requests were not cancelled"


# ---- A4. schema fuzz (schemathesis, all checks) -------------------------------------------------------------------
FUZZ_EXAMPLES = 15        # per operation and generation mode (fuzzing phase; the coverage phase adds its own)
_FUZZ_CASES = {"positive": 0, "negative": 0}
_FUZZ_STATUSES: dict[int, int] = {}
_FUZZ_SECONDS = {"positive": 0.0, "negative": 0.0}
_FUZZ_FAILED: dict[str, set] = {"positive": set(), "negative": set()}   # operations with a failing case


def _narrow(node, *, strings: int = 4, items: int = 3):
    """Bounds every string and array under a JSON-schema node (a subset of what it allows: generated
    prompts stay short, so a valid request is also a cheap one)."""
    if isinstance(node, list):
        for x in node:
            _narrow(x, strings=strings, items=items)
        return
    if not isinstance(node, dict):
        return
    if node.get("type") == "string" and not {"enum", "const", "format", "pattern"} & set(node):
        node["maxLength"] = max(min(node.get("maxLength", strings), strings), node.get("minLength", 0))
    if node.get("type") == "array":
        node["maxItems"] = max(min(node.get("maxItems", items), items), node.get("minItems", 0))
    for value in node.values():
        _narrow(value, strings=strings, items=items)


def _bound_ints(node, lo: int, hi: int):
    if isinstance(node, list):
        for x in node:
            _bound_ints(x, lo, hi)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            node["minimum"] = max(node.get("minimum", lo), lo)
            node["maximum"] = max(min(node.get("maximum", hi), hi), node["minimum"])
        for value in node.values():
            _bound_ints(value, lo, hi)


def positive_document(doc: dict) -> dict:
    """The server's schema with its request bodies narrowed for generating valid requests that stay cheap
    and inside the context: strings of 4 characters and lists of 3 at most (3 chat messages of 3 parts stay
    under 256 tokens even at 4 UTF-8 bytes a character: 8 and 4 once gave 288), token ids inside tiny's
    bytes, at most 8 new tokens, n at most 2, best_of 1, the served model's name. Only narrowed: every
    request it allows, the server's schema allows too."""
    doc = copy.deepcopy(doc)
    refs = set()
    for path in doc.get("paths", {}).values():
        for op in path.values():
            for media in ((op.get("requestBody") or {}).get("content") or {}).values():
                refs |= set(json.dumps(media.get("schema", {})).split('"#/components/schemas/')[1:])
    names = {r.split('"')[0] for r in refs}
    schemas = doc.get("components", {}).get("schemas", {})
    for name in list(names):   # the request bodies and everything they refer to
        names |= {r.split('"')[0] for r in json.dumps(schemas.get(name, {})).split('"#/components/schemas/')[1:]}
    for name in names:
        schema = schemas.get(name, {})
        _narrow(schema)
        props = schema.get("properties", {})
        for token_field in ("prompt", "stop_token_ids"):
            if token_field in props:
                _bound_ints(props[token_field], 0, 255)
        for count in ("max_tokens", "max_completion_tokens"):
            if count in props:
                _bound_ints(props[count], -(1 << 31), 8)
        # a limit always given: none means "the rest of the context", 200+ tokens a request here
        count = "max_completion_tokens" if "max_completion_tokens" in props else "max_tokens"
        if count in props:
            props[count] = next((s for s in props[count].get("anyOf", []) if s.get("type") == "integer"), props[count])
            schema["required"] = sorted(set(schema.get("required", [])) | {count})
        if "n" in props:
            _bound_ints(props["n"], -(1 << 31), 2)
        if "best_of" in props:   # best_of must equal n: a rule between two fields, not in JSON Schema
            props["best_of"] = {"type": "null"}
        if "model" in props:
            props["model"] = {"type": "string", "enum": [MODEL]}
    return doc


def _schema(srv, doc: dict, mode: str):
    config = schemathesis.Config.from_dict({
        "headers": {"Authorization": f"Bearer {KEY}"},
        "request-timeout": 60,
        "max-stream-events": 2000,
        "generation": {"mode": mode, "max-examples": FUZZ_EXAMPLES},
        "phases": {"stateful": {"enabled": False}},
        "output": {"sanitization": {"enabled": False}},   # it hides every field named like "*token*"
    })
    schema = schemathesis.openapi.from_dict(doc, config=config)
    schema.config.update(base_url=srv.url(""))
    return schema


@pytest.fixture(scope="module")
def openapi_document(server):
    r = server.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


@pytest.fixture(scope="module")
def positive_schema(server, openapi_document):
    return _schema(server, positive_document(openapi_document), "positive")


@pytest.fixture(scope="module")
def negative_schema(server, openapi_document):
    return _schema(server, openapi_document, "negative")


def _call_and_validate(case, mode: str):
    started = time.time()
    try:
        response = case.call_and_validate(headers={"Authorization": f"Bearer {KEY}"})
        _FUZZ_STATUSES[response.status_code] = _FUZZ_STATUSES.get(response.status_code, 0) + 1
    except (Exception, BaseExceptionGroup):   # schemathesis' FailureGroup is a BaseExceptionGroup
        _FUZZ_FAILED[mode].add(f"{case.operation.method.upper()} {case.operation.path}")
        raise
    finally:
        _FUZZ_CASES[mode] += 1
        _FUZZ_SECONDS[mode] += time.time() - started


_SETTINGS = hypothesis.settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize=True, database=None,
                                suppress_health_check=list(hypothesis.HealthCheck))

positive = schemathesis.pytest.from_fixture("positive_schema")
negative = schemathesis.pytest.from_fixture("negative_schema").include(method="POST")   # GETs take nothing invalid


@positive.parametrize()
@_SETTINGS
def test_schema_fuzz_valid_requests(case):
    """Schema-valid requests (narrowed to stay cheap): no 5xx, accepted, answers as the schema says."""
    _call_and_validate(case, "positive")


@negative.parametrize()
@_SETTINGS
def test_schema_fuzz_invalid_requests(case):
    """Requests the schema forbids: rejected with a 4xx the schema documents, never a 5xx."""
    _call_and_validate(case, "negative")


def test_schema_fuzz_figures_and_health(server, figures):
    """After the fuzz: the server is healthy, idle, and serving; the fuzz's figures."""
    assert server.get("/health").status_code == 200
    wait_until_idle(server, 10)
    out = server.post(C, {"prompt": "ok", "max_tokens": 2, "ignore_eos": True})
    assert out.status_code == 200, out.text
    statuses = ", ".join(f"{n} x {s}" for s, n in sorted(_FUZZ_STATUSES.items()))
    figures(f"reliability: schema fuzz of /openapi.json (schemathesis {schemathesis.__version__}, all checks, "
            f"{FUZZ_EXAMPLES} examples per operation and mode + coverage cases): {_FUZZ_CASES['positive']} valid "
            f"cases in {_FUZZ_SECONDS['positive']:.1f} s, {_FUZZ_CASES['negative']} invalid cases in "
            f"{_FUZZ_SECONDS['negative']:.1f} s; statuses {statuses}; operations with a failing check: valid "
            f"{sorted(_FUZZ_FAILED['positive']) or 'none'}, invalid {sorted(_FUZZ_FAILED['negative']) or 'none'}")
    assert _FUZZ_CASES["positive"] and _FUZZ_CASES["negative"], "the fuzz tests did not run"
    assert not _FUZZ_FAILED["positive"] and not _FUZZ_FAILED["negative"], \
        f"schemathesis checks failed (see the fuzz tests above): {_FUZZ_FAILED}"
    assert not any(s >= 500 for s in _FUZZ_STATUSES), _FUZZ_STATUSES


# ---- A5. a killed worker ------------------------------------------------------------------------------------------
@pytest.fixture
def doomed_server():
    srv = LiveServer([*BASE_ARGS, "--max-model-len", "8192"], api_key=KEY)
    yield srv
    srv.stop()


def test_killed_worker_is_503_within_2_s_and_ends_every_request(doomed_server, figures):
    srv = doomed_server
    workers = worker_pids(srv.proc.pid)
    assert len(workers) == 2, f"expected 2 worker processes, found {workers}"
    # 6 prompts of 8 tokens take a page each per worker when admitted (nothing is reserved for max_tokens): all run
    long = {"model": MODEL, "max_tokens": 3000, "ignore_eos": True, "temperature": 0}
    streams, plain = 4, 2
    results: dict[int, dict] = {}
    running = [threading.Event() for _ in range(streams)]

    def stream(i):
        out = {"events": [], "status": None}
        try:
            with httpx.stream("POST", srv.url(C), headers=srv.headers, timeout=TIMEOUT,
                              json={**long, "prompt": _ids(i), "stream": True}) as r:
                out["status"] = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data:"):
                        out["events"].append(sse_payloads([line])[0])
                        running[i].set()
        except Exception as e:   # noqa: BLE001  (a closed connection is recorded, not raised)
            out["exception"] = repr(e)
        out["ended"] = time.time()
        results[i] = out

    def whole(i):
        out = {"status": None}
        try:
            r = httpx.post(srv.url(C), headers=srv.headers, timeout=TIMEOUT, json={**long, "prompt": _ids(i)})
            out["status"], out["response"] = r.status_code, r
        except Exception as e:   # noqa: BLE001
            out["exception"] = repr(e)
        out["ended"] = time.time()
        results[i] = out

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
    threads += [threading.Thread(target=whole, args=(streams + i,), daemon=True) for i in range(plain)]
    for t in threads:
        t.start()
    _wait_running(srv, running, results)   # every stream has its first event
    deadline = time.time() + 10
    while busy(metrics(srv))[0] < streams + plain and time.time() < deadline:   # the plain ones run too
        time.sleep(0.05)
    in_flight = busy(metrics(srv))[0]
    assert in_flight == streams + plain, f"{in_flight} requests running before the kill, not {streams + plain}"
    victim = workers[-1]
    os.kill(victim, signal.SIGKILL)
    killed = time.time()
    health = None
    while time.time() - killed < 10:
        health = srv.get("/health", timeout=2)
        if health.status_code == 503:
            break
        time.sleep(0.02)
    to_503 = time.time() - killed
    t0 = time.time()
    new = srv.post(C, {"prompt": "hi", "max_tokens": 1}, timeout=5)
    new_seconds = time.time() - t0
    for t in threads:
        t.join(timeout=max(1.0, 15 - (time.time() - killed)))
    problems = []
    for i in range(streams):
        out = results.get(i)
        if out is None:
            problems.append(f"stream {i} still open 15 s after the kill")
            continue
        events = out["events"]
        errors = [e for e in events if isinstance(e, dict) and "error" in e]
        if not errors:
            problems.append(f"stream {i}: no error event (last events {events[-2:]}, {out.get('exception')})")
        elif events[-1] != "[DONE]" or events[-2] is not errors[-1]:
            problems.append(f"stream {i}: the error event is not followed by data: [DONE] ({events[-2:]})")
        elif err := _error_event_problem(errors[-1]):
            problems.append(f"stream {i}: {err}")
    for i in range(streams, streams + plain):
        out = results.get(i)
        if out is None:
            problems.append(f"request {i} still waiting 15 s after the kill")
        elif out["status"] is None or out["status"] < 500:
            problems.append(f"request {i}: status {out['status']} ({out.get('exception')})")
        elif shape := error_shape_problem(out["response"]):
            problems.append(f"request {i}: {shape}")
    ended = [out["ended"] - killed for out in results.values()]
    figures(f"reliability: worker {victim} killed (SIGKILL) with {streams} streams and {plain} non-streaming "
            f"requests running: /health {health.status_code if health else '?'} after {to_503:.2f} s; "
            f"{len(results)}/{streams + plain} in-flight requests ended, the last {max(ended, default=0):.2f} s "
            f"after the kill, {streams + plain - len(problems)} with an error; a new request {new.status_code} "
            f"in {new_seconds:.2f} s")
    # a dead engine answers at once (about 0.1 s here); the bounds only tell that from waiting out a timeout (30 s),
    # with room for a machine loaded by other work
    assert health is not None and health.status_code == 503 and to_503 <= 10, \
        f"/health {health.status_code if health else None} {to_503:.2f} s after the kill"
    openai_error(new, 503)
    assert new_seconds < 10, f"the new request took {new_seconds:.2f} s"
    assert not problems, "\n".join(problems)


def _wait_running(srv, running: list[threading.Event], results: dict, seconds: float = 30) -> None:
    deadline = time.time() + seconds
    for i, event in enumerate(running):
        if not event.wait(max(0.0, deadline - time.time())):
            pytest.fail(f"stream {i} had no event {seconds} s after it started: {results.get(i)}; metrics "
                        f"{busy(metrics(srv))}; server log:\n{srv.log()[-3000:]}")


def _error_event_problem(event: dict) -> str | None:
    err = event.get("error")
    if set(event) != {"error"} or not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
        return f"error event not in OpenAI's shape: {event}"
    if not (err["code"] is None or isinstance(err["code"], str)):
        return f"error event code {err['code']!r} is neither a string nor null"
    return None


# ---- A6. SIGTERM to the whole process group (timeout, systemd, Ctrl-C) -----------------------------------------
def test_sigterm_to_the_process_group_is_a_clean_shutdown():
    """`timeout` and systemd signal the whole group: the workers get SIGTERM with the server. The server shuts
    them down in order, so its log names no failure and no leaked semaphore, and nothing of it is left."""
    srv = LiveServer(BASE_ARGS, api_key=KEY, log_level="info")
    try:
        pid = srv.proc.pid
        family = [pid, *descendants(pid)]
        assert len(worker_pids(pid)) == 2
        assert srv.post(C, {"model": MODEL, "prompt": _ids(0), "max_tokens": 4}).status_code == 200
        running = threading.Thread(target=lambda: srv.post(C, {"model": MODEL, "prompt": _ids(1), "max_tokens": 3000,
                                                               "ignore_eos": True}), daemon=True)
        running.start()                                   # the workers are busy when the signal comes
        time.sleep(1.0)
        os.killpg(pid, signal.SIGTERM)
        srv.proc.wait(timeout=30)
        time.sleep(0.5)                                   # the resource tracker writes its warnings at exit
        log = srv.log()
        assert "engine failed" not in log and "exited with code" not in log, log[-3000:]
        assert "leaked" not in log, log[-3000:]
        assert not [p for p in family if alive(p)], log[-3000:]
    finally:
        srv.stop()


def test_a_worker_ignores_sigterm_and_never_outlives_the_server():
    """The server owns its workers: SIGTERM to a worker alone changes nothing (the server still answers);
    SIGKILL to the server alone, which can shut nothing down, still leaves no worker behind."""
    srv = LiveServer(BASE_ARGS, api_key=KEY)
    try:
        workers = worker_pids(srv.proc.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGTERM)
        time.sleep(1.0)
        assert all(alive(w) for w in workers), "a worker died of SIGTERM"
        assert srv.post(C, {"model": MODEL, "prompt": _ids(2), "max_tokens": 4}).status_code == 200
        os.kill(srv.proc.pid, signal.SIGKILL)
        srv.proc.wait(timeout=10)
        deadline = time.time() + 5
        while any(alive(w) for w in workers) and time.time() < deadline:
            time.sleep(0.1)
        assert not [w for w in workers if alive(w)], "workers outlived the server"
    finally:
        srv.stop()


# ---- A6. SIGTERM, or Ctrl-C (SIGINT to the terminal's process group), with requests in flight ------------------
@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C", "Ctrl-C twice"])
def test_sigterm_with_requests_in_flight_leaves_no_process(how, figures):
    """Every way the streams end with an error event and [DONE], the server exits 0 without a traceback, and
    nothing of it is left; a second Ctrl-C while it shuts down changes nothing (uvicorn's forced exit would skip
    the application's shutdown and print the lifespan's CancelledError)."""
    srv = LiveServer([*BASE_ARGS, "--max-model-len", "8192"], api_key=KEY, log_level="info")
    try:
        pid = srv.proc.pid
        family = [pid, *descendants(pid)]
        workers = worker_pids(pid)
        assert len(workers) == 2, workers
        results, streams = {}, 4
        running = [threading.Event() for _ in range(streams)]

        def stream(i):
            out = {"events": 0, "done": False, "error": False}
            try:
                with httpx.stream("POST", srv.url(C), headers=srv.headers, timeout=TIMEOUT,
                                  json={"model": MODEL, "prompt": _ids(i), "max_tokens": 3000, "ignore_eos": True,
                                        "stream": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            out["events"] += 1
                            out["done"] |= line.strip() == "data: [DONE]"
                            out["error"] |= line.startswith('data: {"error"')
                            running[i].set()
            except Exception as e:   # noqa: BLE001
                out["exception"] = type(e).__name__
            out["ended"] = time.time()
            results[i] = out

        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(streams)]
        for t in threads:
            t.start()
        _wait_running(srv, running, results)
        time.sleep(0.3)
        if how == "SIGTERM":
            srv.proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(pid, signal.SIGINT)                 # a terminal's Ctrl-C reaches the whole group
            if how == "Ctrl-C twice":
                time.sleep(0.05)
                os.killpg(pid, signal.SIGINT)
        sent = time.time()
        try:
            srv.proc.wait(timeout=15)
        except Exception:   # noqa: BLE001  (still running: reported below, then killed)
            pass
        exit_seconds = time.time() - sent
        exited = srv.proc.poll() is not None
        time.sleep(0.5)   # orphans have a moment to go
        left = [p for p in family if alive(p)] + [p for p in group_members(pid) if p not in family]
        for t in threads:
            t.join(timeout=5)
        ends = {i: ("[DONE] after an error event" if o["error"] and o["done"] else "[DONE]" if o["done"]
                    else o.get("exception", "closed")) for i, o in results.items()}
        state = (f"exited ({srv.proc.returncode}) after {exit_seconds:.2f} s, {len(left)} of its {len(family)} "
                 f"processes left" if exited else f"still running {exit_seconds:.0f} s after it")
        figures(f"reliability: {how} with {streams} streams running: server {state}; streams ended: "
                f"{sorted(set(ends.values()))}, {len(results)}/{streams} within 5 s of the exit")
        assert exited, "the server was still running 15 s after SIGTERM"
        assert not left, f"processes left after the server exited: {[(p, cmdline(p)[:120]) for p in left]}"
        assert len(results) == streams, "some streams were still open after the server exited"
        assert set(ends.values()) == {"[DONE] after an error event"}, ends
        log = srv.log()
        assert srv.proc.returncode == 0 and "Traceback" not in log, (srv.proc.returncode, log[-3000:])
        assert f"{'SIGTERM' if how == 'SIGTERM' else 'SIGINT'}: shutting down" in log, log[-3000:]
        assert ("SIGINT again: already shutting down" in log) == (how == "Ctrl-C twice"), log[-3000:]
    finally:
        kill_group(srv.proc.pid)   # at once: a server that ignored SIGTERM is not given 30 s more
        srv.stop()
