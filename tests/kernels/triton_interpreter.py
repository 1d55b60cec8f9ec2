"""Runs a test module's Triton checks in Triton's CPU interpreter, in a fresh process (TRITON_INTERPRET=1
must be set before triton's first import, which this test process has already done)."""
import importlib.util
import os
import subprocess
import sys

import pytest


def run_interpreted(module: str, function: str = "_triton_interpreted_checks") -> None:
    """Imports tests/kernels/<module>.py in a fresh interpreter-mode process and calls its function;
    skips when Triton is not installed, fails with the process's output otherwise."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("no triton")
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([root, here, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", f"import {module} as t; t.{function}()"],
                         env=env, cwd=root, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
