"""What the live-server tests share: the CPU device arguments, a server subprocess whose log is kept,
checkpoints, OpenAI error checks, SSE parsing, metrics, and the server's processes (from /proc)."""
import itertools
import json
import os
import re
import signal
import tempfile
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from burstserve.clients.server_process import RemoteServer

# A CPU server with 2 worker processes (gloo). The one place to change when the device flags change.
DEVICE_ARGS = ["--devices", "cpu", "--context-parallel-size", "2"]
KEY = "test-key"
TIMEOUT = httpx.Timeout(60, connect=10)   # every HTTP call of these tests is bounded


class LiveServer(RemoteServer):
    """RemoteServer whose stdout and stderr go to a temporary file (`log()` reads it until `stop()` removes
    it), with the log level chosen."""

    def __init__(self, args: list[str], api_key: str | None = None, log_level: str = "warning",
                 timeout: float = 180):
        fd, self.log_path = tempfile.mkstemp(prefix="burstserve-", suffix=".log")
        with os.fdopen(fd, "wb") as out:
            super().__init__(args, api_key, timeout, log_level, output=out)

    def _log_tail(self) -> str:
        return ":\n" + self.log()[-4000:]

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        super().stop()
        kill_group(self.proc.pid)   # nothing of it may outlive the test, whatever the test found
        try:
            os.unlink(self.log_path)
        except OSError:
            pass

    def post(self, path: str, body=None, **kw) -> httpx.Response:
        kw.setdefault("headers", self.headers)
        kw.setdefault("timeout", TIMEOUT)
        return httpx.post(self.url(path), json=body, **kw)

    def get(self, path: str, **kw) -> httpx.Response:
        kw.setdefault("headers", self.headers)
        kw.setdefault("timeout", TIMEOUT)
        return httpx.get(self.url(path), **kw)


# ---- checkpoints ----------------------------------------------------------------------------------------
def save_ascii_tokenizer(path: str, vocab_size: int = 320) -> None:
    """A BPE tokenizer in transformers' format whose every id decodes to its own plain-ASCII text (the 95
    printable characters and newline, <s>, </s>, then letter pairs up to `vocab_size`), and a sequence
    decodes to the concatenation of its tokens: token texts and offsets can be checked exactly (the
    byte-level tokenizer of hf_reference has ids that decode alone to U+FFFD). Chat template: hf_reference's."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    from hf_reference import CHAT_TEMPLATE
    vocab = {c: i for i, c in enumerate([chr(c) for c in range(32, 127)] + ["\n"])}
    vocab.update({"<s>": len(vocab), "</s>": len(vocab) + 1})
    merges = []
    for a, b in itertools.product("etaoinshrdlucmfwyp", repeat=2):
        if len(vocab) == vocab_size:
            break
        merges.append((a, b))
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.decoder = decoders.Fuse()
    assert tok.get_vocab_size() == vocab_size
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)


def ascii_checkpoint(path: str, seed: int):
    """hf_reference's llama3-gqa checkpoint (vocabulary 320) with the ASCII tokenizer; returns the model."""
    from hf_reference import save_checkpoint
    model = save_checkpoint("llama3-gqa", path, seed=seed)
    save_ascii_tokenizer(path)
    return model


# ---- OpenAI's error JSON ----------------------------------------------------------------------------------
def error_shape_problem(r: httpx.Response) -> str | None:
    """Why `r` is not an error in OpenAI's shape {"error": {"message": str, "type": str, "param": str|null,
    "code": str|null}} (None when it is)."""
    if not r.headers.get("content-type", "").startswith("application/json"):
        return f"content-type {r.headers.get('content-type')!r}, not JSON: {r.text[:200]!r}"
    try:
        body = r.json()
    except ValueError:
        return f"not JSON: {r.text[:200]!r}"
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return f"not {{'error': {{...}}}}: {body!r}"
    err = body["error"]
    if set(err) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(err)}, not message/type/param/code: {err!r}"
    if not isinstance(err["message"], str) or not err["message"]:
        return f"message {err['message']!r} is not a non-empty string"
    if not isinstance(err["type"], str) or not err["type"]:
        return f"type {err['type']!r} is not a non-empty string"
    if err["param"] is not None and not isinstance(err["param"], str):
        return f"param {err['param']!r} is neither a string nor null"
    if err["code"] is not None and not isinstance(err["code"], str):
        return f"code {err['code']!r} is neither a string nor null (OpenAI's codes are strings)"
    return None


PYDANTIC_TAG = re.compile(r"\.(str|int|float|bool|list\[|dict\[|function-|tagged-union|union\[|literal\[)")


def param_names(param: str | None, field: str) -> bool:
    """`param` names `field`: the field itself or a part of it (`messages.0.role`, `response_format.type`),
    without pydantic's names of union branches (`prompt.str`, `stop.list[str]`)."""
    if param is None or PYDANTIC_TAG.search(param):
        return False
    return param == field or param.startswith((field + ".", field + "["))


def openai_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """Asserts `r` is an OpenAI error with that status (and a param naming `param`, and `code`, when given);
    returns its "error"."""
    assert r.status_code == status, f"{r.status_code}, not {status}: {r.text[:500]}"
    problem = error_shape_problem(r)
    assert problem is None, problem
    err = r.json()["error"]
    if param is not None:
        assert param_names(err["param"], param), f"param {err['param']!r} does not name {param!r}: {err}"
    if code is not None:
        assert err["code"] == code, err
    return err


# ---- server-sent events -------------------------------------------------------------------------------
def sse_payloads(lines) -> list:
    """The `data:` payloads of an SSE stream, decoded (JSON) or as the string "[DONE]"."""
    out = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ---- metrics ----------------------------------------------------------------------------------------
def metrics(srv) -> dict:
    """'name{"label": "value"}' (labels sorted, model_name left out) -> value."""
    text = httpx.get(srv.url("/metrics"), timeout=10).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + json.dumps({k: v for k, v in sorted(sample.labels.items()) if k != "model_name"})
            values[key] = sample.value
    return values


def busy(values: dict) -> tuple[float, list[float]]:
    """(requests running, every worker's KV usage) from `metrics`."""
    kv = [v for k, v in values.items() if k.startswith("burstserve:kv_cache_usage_perc")]
    return values.get("burstserve:num_requests_running{}", 0), kv


def wait_until_idle(srv, seconds: float = 10) -> dict:
    """The server's metrics once nothing runs and every worker's KV cache is empty; fails after `seconds`."""
    deadline = time.time() + seconds
    while True:
        values = metrics(srv)
        running, kv = busy(values)
        if running == 0 and not any(kv):
            return values
        if time.time() > deadline:
            pytest.fail(f"after {seconds} s: {running} request(s) still running, KV usage per worker {kv}")
        time.sleep(0.1)


def delta(after: dict, before: dict, key: str) -> float:
    return after.get(key, 0) - before.get(key, 0)


# ---- processes (from /proc: psutil is not installed) ----------------------------------------------------------
def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else ():
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return out


def descendants(pid: int) -> list[int]:
    out, todo = [], children(pid)
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children(p)
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def worker_pids(server_pid: int) -> list[int]:
    """The engine's worker processes: the server's multiprocessing-spawned children, oldest first."""
    return sorted(p for p in children(server_pid) if "spawn_main" in cmdline(p))


def alive(pid: int) -> bool:
    """True for a process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(name))
    return out


def kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def printable_window(text: str) -> str | None:
    """Two printable ASCII characters of a generated text (after its first two), to use as a stop string."""
    for i in range(2, len(text) - 1):
        window = text[i:i + 2]
        if window.isascii() and window.isprintable() and window.strip():
            return window
    return None
