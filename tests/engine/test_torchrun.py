"""The worker entry point under torchrun (RANK / WORLD_SIZE / MASTER_ADDR) gives the tokens `LLM` gives."""
import json
import os
import random
import subprocess
import sys

from burstserve.engine import LLM, SamplingParams
from burstserve.clients.server_process import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_torchrun_workers_match_llm(tmp_path):
    prompts = [[random.randrange(512) for _ in range(n)] for n in (3, 40)]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-port", str(free_port()),
           "-m", "burstserve.engine.worker", "--model", "tiny", "--device", "cpu", "--prompts", str(tmp_path / "prompts.json"),
           "--max-tokens", "8"]
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = [json.loads(line)["token_ids"] for line in proc.stdout.splitlines() if line.startswith("{")]
    with LLM("tiny", devices="cpu", context_parallel_size=3) as llm:
        want = [o.outputs[0].token_ids for o in
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]
    assert got == want
