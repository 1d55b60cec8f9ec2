"""One engine over two "hosts" on this machine (issue 15): a head (`burstserve serve --nnodes 2`, 2 CPU
workers, the HTTP server) and a second host (`burstserve worker --node-rank 1`, 2 CPU workers) joining
over 127.0.0.1. Its greedy tokens and logprobs over HTTP equal transformers'; killing the second host
makes /health 503 within a few seconds and ends an in-flight stream with an error event; a host with
another dtype is refused, naming it, and a head whose second host never joins fails at start naming the
missing node rank."""
import os
import random
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch

from burstserve.clients.server_process import free_port
from paths import ROOT
from hf_reference import hf_next_logits_and_greedy
from live import LiveServer, ascii_checkpoint, kill_group, sse_payloads

ENGINE_ARGS = ["--devices", "cpu", "-cp", "2", "--dtype", "float32"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("two-hosts"))
    return path, ascii_checkpoint(path, seed=random.randrange(1 << 30))


def _rendezvous_port() -> int:
    """A free port whose next one is free too (the workers' process group takes it)."""
    while True:
        port = free_port()
        try:
            import socket
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue


def _joiner(path: str, port: int, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "burstserve.server.cli", "worker", "--model", path, *ENGINE_ARGS, "--nnodes", "2",
           "--node-rank", "1", "--master-port", str(port), "--join-timeout", "60", "--log-level", "info", *extra]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _head_args(path: str, port: int, timeout: float = 60) -> list[str]:
    return ["--model", path, "--served-model-name", "m", *ENGINE_ARGS, "--nnodes", "2", "--master-port", str(port),
            "--join-timeout", str(timeout), "--max-model-len", "512", "--kv-cache-tokens", "4096"]


def _start_head(args: list[str], box: dict) -> threading.Thread:
    """The head's LiveServer returns once healthy, which needs the joiner: start it in a thread."""
    def run():
        try:
            box["server"] = LiveServer(args, log_level="info", timeout=180)
        except Exception as e:
            box["error"] = e
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("death", ["killed", "hung"])
def test_two_hosts_serve_transformers_tokens_and_a_dead_host_gives_503(checkpoint, death):
    """killed: the second host's processes SIGKILLed (its connections reset); hung: SIGSTOPped (nothing
    resets: only its stopped heartbeat tells)."""
    path, model = checkpoint
    port = _rendezvous_port()
    box: dict = {}
    head = _start_head(_head_args(path, port), box)
    joiner = _joiner(path, port)
    try:
        head.join(timeout=200)
        assert "server" in box, box.get("error")
        srv = box["server"]
        for n in (3, 50):                                       # rank 0 .. 3 over two hosts: ring crosses them
            prompt = [random.randrange(2, 320) for _ in range(n)]
            _, ref_tokens = hf_next_logits_and_greedy(model, prompt, 6)
            with torch.no_grad():
                logits = model(torch.tensor([prompt + ref_tokens])).logits[0, n - 1:-1].float()
            ref_logp = torch.log_softmax(logits, dim=-1)
            body = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 1,
                    "ignore_eos": True, "return_tokens_as_token_ids": True}
            choice = srv.post("/v1/completions", body).json()["choices"][0]
            tokens = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
            assert tokens == ref_tokens, n
            for i, (t, lp) in enumerate(zip(tokens, choice["logprobs"]["token_logprobs"])):
                assert abs(lp - ref_logp[i, t].item()) < 1e-3, (n, i)
        assert "node rank 1 joined with 2 worker(s)" in srv.log()

        events: list = []
        body = {"model": "m", "prompt": [5] * 20, "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                "stream": True}

        def stream():
            with httpx.stream("POST", srv.url("/v1/completions"), json=body, timeout=60) as r:
                events.extend(sse_payloads(r.iter_lines()))
        reader = threading.Thread(target=stream, daemon=True)
        reader.start()
        time.sleep(1.0)                                         # the stream is running
        os.killpg(joiner.pid, signal.SIGKILL if death == "killed" else signal.SIGSTOP)   # agent and workers
        killed = time.monotonic()
        while srv.get("/health").status_code != 503 and time.monotonic() - killed < 30:
            time.sleep(0.2)
        took = time.monotonic() - killed
        assert srv.get("/health").status_code == 503
        assert took < 10, took
        reader.join(timeout=30)
        assert events and events[-1] == "[DONE]" and any(isinstance(e, dict) and "error" in e for e in events), events[-3:]
        failed = [line for line in srv.log().splitlines() if "engine failed" in line]
        print(f"{death}: /health 503 after {took:.1f} s; {failed[:1]}")
        assert failed, srv.log()[-3000:]
        if death == "hung":
            assert "node rank 1 stopped answering (no heartbeat for" in failed[0], failed
    finally:
        kill_group(joiner.pid)
        if "server" in box:
            box["server"].stop()


def test_a_mismatched_host_is_refused_and_a_missing_one_fails_the_head(checkpoint):
    """A joiner with another dtype is refused with the field named (exit 2); the head keeps waiting for a
    matching host, and at --join-timeout fails at start naming node rank 1 and why it was refused."""
    path, _ = checkpoint
    port = _rendezvous_port()
    box: dict = {}
    head = _start_head(_head_args(path, port, timeout=12), box)
    time.sleep(3)
    joiner = _joiner(path, port, "--dtype", "bfloat16")
    try:
        out, _ = joiner.communicate(timeout=60)
        assert joiner.returncode == 2, out
        assert "refused node rank 1: its dtype is 'bfloat16', the head's is 'float32'" in out, out
        head.join(timeout=90)
        error = str(box.get("error"))
        assert "server exited with 2" in error, error
        assert "node rank(s) 1 did not join" in error and "was refused: its dtype" in error, error[-2000:]
    finally:
        kill_group(joiner.pid)
        if "server" in box:
            box["server"].stop()


def test_single_cannot_span_hosts():
    """`single` runs on one device: asked for with --nnodes 2 it is refused before anything starts."""
    from burstserve.engine import LLM
    from burstserve.engine.core.errors import InvalidRequestError
    with pytest.raises(InvalidRequestError, match="cannot span hosts"):
        LLM("tiny", devices="cpu", sp_strategy="single", nnodes=2, master_port=free_port())
