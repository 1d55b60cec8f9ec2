"""Triton kernels built on first use, with the torch ops as the path wherever they are not there.

Each module with Triton kernels holds one LazyTriton over its build function:

    _triton = LazyTriton(_build, "fused")
    kern = _triton.kernels(x.device)       # the built kernels, or None: not CUDA, no Triton, or failed
    if kern is not None:
        try:
            return _op_triton(kern["op"], ...)
        except Exception as e:             # compile or launch failure
            _triton.failed(e)              # logged once; the torch ops from now on
    return _op_torch(...)

The build function imports Triton (only when a kernel is first wanted: the CPU never imports it) and
defines its kernels inside itself, after binding its module's global `tl` (`global tl; import
triton.language as tl`): a Triton kernel resolves `tl` as a global of the module it is defined in.
It returns a fresh set each call, so tests can build interpreted kernels (TRITON_INTERPRET=1) and
run them on the CPU.
"""
import logging
from typing import Callable, Generic, TypeVar

import torch

log = logging.getLogger(__name__)
K = TypeVar("K")


class LazyTriton(Generic[K]):
    """One module's Triton kernels: built once, on the first CUDA call, and given up for good (the torch
    ops serve) after any failure to build, compile or launch. `enabled` is the switch: failed() clears it,
    and tests clear it (monkeypatch) to run the torch ops on CUDA."""

    def __init__(self, build: Callable[[], K], name: str):
        self.build = build            # -> a fresh set of jitted kernels
        self.name = name              # for the log line
        self.enabled = True
        self._built: K | None = None
        self._tried = False

    def kernels(self, device: torch.device) -> K | None:
        """The built kernels for a CUDA device while enabled, else None (the caller runs its torch ops)."""
        if device.type != "cuda" or not self.enabled:
            return None
        if not self._tried:
            self._tried = True
            try:
                self._built = self.build()
            except Exception as e:   # ImportError: no Triton
                self.failed(e)
        return self._built if self.enabled else None

    def failed(self, e: Exception) -> None:
        """A kernel failed to build, compile or launch: log it (once) and use the torch ops from now on."""
        if self.enabled:
            log.warning("%s Triton kernels failed (%s: %s); using torch ops", self.name, type(e).__name__, e)
        self.enabled = False


tl = None   # triton.language, bound by e4m3_by_arithmetic (its jitted function resolves it as a global)


def e4m3_by_arithmetic():
    """A jitted function x (fp32) -> the nearest e4m3 value (ties to even, saturating at 448, x's sign kept, -0's
    too) as fp32, computed with fp32 arithmetic: what a kernel uses in place of `.to(tl.float8e4nv)` under the Triton
    interpreter, whose fp32 -> e4m3 cast drops the carry into the exponent (31.9 -> 16). For kernels'
    build functions (kernels/kv_quant.py, kernels/fa3_fp8.py); Triton imported here, on first use."""
    global tl
    import triton
    import triton.language as tl

    def e4m3(x):
        a = tl.minimum(tl.abs(x), 448.0)
        step = tl.exp2(tl.floor(tl.log2(tl.maximum(a, 0.015625))) - 3.0)     # 3 mantissa bits; 2^-6: subnormals
        big = step * 12582912.0                                               # 1.5 * 2^23 steps: fp32 rounds
        r = (a + big) - big
        return tl.where(x.to(tl.int32, bitcast=True) < 0, r * -1.0, r)      # x's sign bit: -0 stays -0

    return triton.jit(e4m3)


def bf16_by_bits():
    """A jitted function x (fp32) -> x rounded to bf16 (nearest even) as fp32, by its bits: what a kernel uses in
    place of `.to(tl.bfloat16)` under the Triton interpreter, whose fp32 -> bf16 cast does not round to nearest
    even (kernels/kv_quant.py, kernels/fa3_fp8.py)."""
    global tl
    import triton
    import triton.language as tl

    def bf16(x):
        bits = x.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)

    return triton.jit(bf16)
