"""kernels/triton_setup.py: kernels built once, on the first CUDA call; none off CUDA; a failure logged once
and the torch ops for good. (torch.device("cuda") is only a name here: nothing runs on a GPU.)"""
import logging

import torch

from burstserve.kernels.triton_setup import LazyTriton

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_built_once_on_the_first_cuda_call_and_never_off_cuda():
    builds = []
    lazy = LazyTriton(lambda: builds.append(1) or {"k": object()}, "test")
    assert lazy.kernels(CPU) is None and builds == []
    first = lazy.kernels(CUDA)
    assert first is lazy.kernels(CUDA) and builds == [1]
    lazy.enabled = False                                     # the tests' switch: the torch ops
    assert lazy.kernels(CUDA) is None


def test_a_failure_is_logged_once_and_the_torch_ops_serve_for_good(caplog):
    builds = []

    def broken():
        builds.append(1)
        raise ImportError("no triton")
    lazy = LazyTriton(broken, "test")
    with caplog.at_level(logging.WARNING, logger="burstserve.kernels.triton_setup"):
        assert lazy.kernels(CUDA) is None and lazy.kernels(CUDA) is None
        lazy.failed(RuntimeError("a launch failed too"))
    assert builds == [1] and not lazy.enabled
    assert [r.getMessage() for r in caplog.records] == [
        "test Triton kernels failed (ImportError: no triton); using torch ops"]


def test_a_launch_failure_after_a_good_build_turns_the_kernels_off(caplog):
    lazy = LazyTriton(lambda: {"k": 1}, "test")
    assert lazy.kernels(CUDA) == {"k": 1}
    with caplog.at_level(logging.WARNING, logger="burstserve.kernels.triton_setup"):
        lazy.failed(RuntimeError("out of resources"))
        lazy.failed(RuntimeError("again"))
    assert lazy.kernels(CUDA) is None and len(caplog.records) == 1
