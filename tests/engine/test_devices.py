"""engine/core/devices.py: `devices` named as torch names them, the context parallel size apart, and the
errors a user sees (from the API, `burstserve serve` and `burstserve bench`) when the machine cannot
satisfy them. GPUs are simulated by patching torch.cuda."""
import os
import subprocess
import sys

import pytest
import torch

from paths import ROOT
from burstserve.engine import LLM, DeviceSpecError
from burstserve.engine.core.devices import default_devices, parse_devices, resolve_devices


def visible(monkeypatch, count: int) -> None:
    """Makes torch report `count` visible CUDA GPUs (0: none)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.fixture
def no_gpu(monkeypatch):
    visible(monkeypatch, 0)


@pytest.mark.parametrize("spec,size,expected", [
    ("cpu", None, ["cpu"]),
    ("cpu:0", None, ["cpu"]),
    (" CPU ", None, ["cpu"]),
    ("cpu", 1, ["cpu"]),
    ("cpu", 3, ["cpu"] * 3),
    ("cpu:0", 2, ["cpu"] * 2),
    (None, None, ["cpu"]),
    ("", 2, ["cpu"] * 2),
])
def test_cpu(no_gpu, spec, size, expected):
    assert resolve_devices(spec, size) == expected


@pytest.mark.parametrize("gpus,spec,size,expected", [
    (2, "cuda:1", None, ["cuda:1"]),
    (2, "cuda:0,1", None, ["cuda:0", "cuda:1"]),
    (2, "cuda", None, ["cuda:0", "cuda:1"]),
    (2, None, None, ["cuda:0", "cuda:1"]),
    (8, "cuda:0,2", None, ["cuda:0", "cuda:2"]),
    (8, "cuda:0, 2", None, ["cuda:0", "cuda:2"]),
    (8, "cuda", 2, ["cuda:0", "cuda:1"]),
    (8, None, 2, ["cuda:0", "cuda:1"]),
    (8, "cuda:6,2,4", 2, ["cuda:6", "cuda:2"]),       # the first N named, in the order named
    (8, "cuda:3", 1, ["cuda:3"]),
    (8, "cpu", 4, ["cpu"] * 4),                       # the CPU even where GPUs are visible
])
def test_cuda(monkeypatch, gpus, spec, size, expected):
    visible(monkeypatch, gpus)
    assert resolve_devices(spec, size) == expected


def test_parse_names_devices_only(monkeypatch):
    visible(monkeypatch, 4)
    assert parse_devices("cuda") == [f"cuda:{i}" for i in range(4)] and parse_devices("cpu:0") == ["cpu"]
    assert default_devices() == "cuda"
    visible(monkeypatch, 0)
    assert default_devices() == "cpu"


@pytest.mark.parametrize("gpus,spec,size,message", [
    (2, "cuda:3", None, "--devices cuda:3 names GPU 3, but 2 GPUs are visible (cuda:0, cuda:1)"),
    (2, "cuda:0,5", None, "--devices cuda:0,5 names GPU 5, but 2 GPUs are visible (cuda:0, cuda:1)"),
    (1, "cuda:1", None, "names GPU 1, but 1 GPU is visible (cuda:0); for 1 workers on the first GPUs use "
                        "--devices cuda --context-parallel-size 1"),
    (4, "cuda:4", None, "use --devices cuda --context-parallel-size 4"),      # the old meaning of cuda:4
    (8, "cuda:0,2", 4, "context parallel size 4 needs 4 devices, but --devices cuda:0,2 names 2 (cuda:0, cuda:2); "
                       "use --context-parallel-size 2 or less, or name more of the visible GPUs"),
    (2, "cuda", 4, "context parallel size 4 needs 4 devices, but --devices cuda names 2 (cuda:0, cuda:1)"),
    (2, None, 3, "but --devices cuda names 2"),
    (0, "cuda", None, "no CUDA GPU is visible; use --devices cpu"),
    (0, "cuda:0", None, "no CUDA GPU is visible; use --devices cpu"),
    (0, "cuda:0,1", 2, "no CUDA GPU is visible; use --devices cpu"),
    (4, "cuda:1,1", None, "--devices cuda:1,1 names GPU 1 twice"),
    (4, "cuda:x", None, "'x' is not a GPU index"),
    (4, "cuda:0,", None, "'' is not a GPU index"),
    (4, "cuda:-1", None, "'-1' is not a GPU index"),
    (4, "cuda:", None, "--devices cuda: is not a device: use cpu, cuda, cuda:1 or cuda:0,2"),
    (4, "tpu", None, "--devices tpu is not a device: use cpu, cuda, cuda:1 or cuda:0,2"),
    (4, "gpu:0", None, "--devices gpu:0 is not a device"),
    (0, "cpu:2", None, "--devices cpu:2 is not a worker count any more: use --devices cpu --context-parallel-size 2"),
    (0, "cpu:3", 3, "use --devices cpu --context-parallel-size 3"),
    (0, "cpu:x", None, "--devices cpu:x is not a device: use --devices cpu"),
    (0, "cpu", 0, "context parallel size 0 is less than 1"),
    (0, "cpu", -2, "context parallel size -2 is less than 1"),
    (2, "cuda", 0, "context parallel size 0 is less than 1"),
    (0, "cpu", "2", "context parallel size '2' is not a whole number"),
    (0, "cpu", 1.5, "context parallel size 1.5 is not a whole number"),
])
def test_errors_name_what_is_there(monkeypatch, gpus, spec, size, message):
    visible(monkeypatch, gpus)
    with pytest.raises(DeviceSpecError) as e:
        resolve_devices(spec, size)
    assert message in str(e.value)


def test_llm_refuses_before_starting_workers(no_gpu):
    with pytest.raises(DeviceSpecError, match="use --devices cpu --context-parallel-size 2"):
        LLM("tiny", devices="cpu:2")
    with pytest.raises(DeviceSpecError, match="less than 1"):
        LLM("tiny", devices="cpu", context_parallel_size=0)
    with pytest.raises(DeviceSpecError, match="no CUDA GPU is visible"):
        LLM("tiny", devices="cuda:0")


def test_single_runs_on_the_first_worker_device():
    with LLM("tiny", devices="cpu", context_parallel_size=2, sp_strategy="single") as llm:
        assert llm.engine.devices == ["cpu"]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "burstserve.server.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)


def assert_one_line_error(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if message in line]
    assert len(errors) == 1 and "error" in errors[0].lower(), proc.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_serve_without_a_gpu_exits_2_with_one_line():
    proc = cli("serve", "--devices", "cuda:0", "--port", "1")
    assert_one_line_error(proc, "--devices cuda:0: no CUDA GPU is visible; use --devices cpu")


def test_serve_and_bench_refuse_the_old_worker_count(tmp_path):
    assert_one_line_error(cli("serve", "--devices", "cpu:2", "--port", "1"),
                          "use --devices cpu --context-parallel-size 2")
    out = tmp_path / "out"
    assert_one_line_error(cli("bench", "sweep", "--offline", "--devices", "cpu", "-cp", "0", "--output-dir", str(out)),
                          "context parallel size 0 is less than 1")
    assert_one_line_error(cli("bench", "sweep", "--offline", "--sp-strategy", "transformers", "--devices", "cpu",
                              "--context-parallel-size", "2", "--output-dir", str(out)),
                          "transformers runs on one device")
    assert not out.exists()      # refused before any file is written
    # --devices / -cp of a sweep reach the server --serve starts: its one line, then the bench's
    proc = cli("bench", "sweep", "--serve", "--model tiny", "--devices", "cpu:2", "--output-dir", str(out))
    assert_one_line_error(proc, "use --devices cpu --context-parallel-size 2")
    assert "burstserve bench: error: --serve '--model tiny': server exited with 2" in proc.stderr


@pytest.mark.parametrize("backend", ["flash-attn", "cudnn"])
def test_a_gpu_attention_backend_is_refused_on_cpu_before_any_worker(backend):
    from burstserve.engine import LLM
    with pytest.raises(DeviceSpecError, match=f"--attention-backend {backend} needs CUDA GPUs, but the devices are cpu"):
        LLM(model="tiny", devices="cpu", attention_backend=backend)


def test_attention_backend_on_the_command_line_is_one_line_and_exit_2():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "burstserve.server.cli", "serve", "--devices", "cpu", "--attention-backend",
                        "flash-attn"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--attention-backend flash-attn needs CUDA GPUs" in r.stderr


def test_reference_and_flash_backends_serve_on_cpu_alike():
    """`reference` and `flash` (PyTorch's CPU flash kernel, what auto picks on CPU) by name: the same
    greedy tokens and logprobs (fp32) for a fresh random prompt."""
    import random
    from burstserve.engine import LLM, SamplingParams
    from hf_reference import assert_same_logprobs
    prompt = [random.randrange(300) for _ in range(random.randrange(50, 400))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = {}
    for backend in ("reference", "flash", "auto"):
        with LLM(model="tiny", devices="cpu", dtype="float32", attention_backend=backend) as llm:
            outs[backend] = llm.generate([prompt], params)[0].outputs[0]
            assert llm.kernel == {"auto": "flash"}.get(backend, backend)
    ref = outs["reference"]
    for backend in ("flash", "auto"):
        assert outs[backend].token_ids == ref.token_ids and len(ref.token_ids) == 6
        for got, want in zip(outs[backend].logprobs, ref.logprobs):
            assert_same_logprobs(got, want, 1e-4)
