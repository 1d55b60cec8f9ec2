"""Starts the real server as a subprocess on a free port and waits for /health (as vLLM's
RemoteOpenAIServer does): used by `burstserve bench --serve ...` and by the tests."""
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

# the folder holding the burstserve package (for PYTHONPATH: a checkout that was not installed works too)
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`burstserve serve ARGS` on a free port; `output`: a file for its stdout and stderr (default: ours)."""

    def __init__(self, args: list[str], api_key: str | None = None, timeout: float = 600,
                 log_level: str = "warning", output=None):
        self.port = free_port()
        self.api_key = api_key
        cmd = [sys.executable, "-m", "burstserve.server.cli", "serve", "--port", str(self.port), "--log-level", log_level, *args]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONPATH=PACKAGE_PARENT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=output,
                                     stderr=subprocess.STDOUT if output is not None else None)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}{self._log_tail()}")
            try:
                if httpx.get(self.url("/health"), timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError(f"server did not become healthy in {timeout} s{self._log_tail()}")

    def _log_tail(self) -> str:
        """The end of the server's output, where a subclass keeps it (LiveServer in the tests)."""
        return ""

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.url("/v1"), api_key=self.api_key or "none", max_retries=0, **kw)

    def async_client(self, **kw):
        import openai
        return openai.AsyncOpenAI(base_url=self.url("/v1"), api_key=self.api_key or "none", max_retries=0, **kw)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
