"""The FP8 kernels as Triton compiles them for a Hopper GPU (sm_90), on this machine without one
(scripts/hopper_codegen.py): their tiles (K/V, the few-rows GEMM's weight) reach shared memory by asynchronous
16-byte copies, never a byte at a time from global memory, and the GEMM runs on FP8 warp-group MMAs. An
argument added to a kernel's do_not_specialize list that carries a tile's alignment (a page or token stride)
fails this: an FP8 prefill kernel (removed since; commit b63512b has it) read its tiles byte by byte, at a
quarter of flash-attn-4's rate, until 9666433."""
import os
import re
import sys

import pytest

pytest.importorskip("triton")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                                "scripts"))
import hopper_codegen  # noqa: E402


@pytest.mark.parametrize("name", ["decode", "small-gemm"])
def test_fp8_tiles_are_copied_asynchronously_not_byte_by_byte(name):
    counts = hopper_codegen.summary(hopper_codegen.compile_for_hopper(name).asm["ptx"])
    assert counts["ld.global.b8"] == 0, counts                                   # byte-wise global loads
    assert counts["cp.async.cg.shared.global"] >= 16, counts                     # 16-byte async tile copies
    if name == "small-gemm":
        assert any(k.startswith("wgmma") and "e4m3.e4m3" in k for k in counts), counts


def test_row_kernels_move_rows_16_bytes_at_a_time():
    """kernels/fused.py's row kernels specialize their sizes and strides: Triton then proves a row 16-byte
    aligned. Unspecialized (in do_not_specialize), silu_and_mul_fp8 loaded 2 bytes and stored 1 at a time,
    at under half the memory's rate (docs/results/log.md, "The row kernels moved a value at a time")."""
    ptx = hopper_codegen.compile_for_hopper("silu-and-mul-fp8").asm["ptx"]
    counts = hopper_codegen.summary(ptx)
    assert counts["ld.global.b16"] == 0 and counts["ld.global.v4.b32"] > 0, counts
    assert "st.global.b8" not in ptx and "st.global.v4.b32" in ptx                # the FP8 row's stores


def test_both_norms_sum_a_row_in_one_layout():
    """rms_norm and rms_norm_fp8 specialize their sizes too, and declare their columns contiguous in runs of 8:
    both then hold 8 values a thread in one layout, so a row's sum comes in one order and the fused FP8 norm
    gives rms_norm-then-quantize_fp8's bits (the GPU test test_fp8_rows_made_by_the_norm_and_silu_kernels_are_
    the_two_steps_bits holds them). Left to itself, Triton laid rms_norm_fp8's row out 16 values a thread."""
    layouts = {}
    for name in ("rms-norm", "rms-norm-fp8"):
        compiled = hopper_codegen.compile_for_hopper(name)
        layouts[name] = set(re.findall(r"#ttg\.blocked<[^>]*>", compiled.asm["ttgir"]))
        counts = hopper_codegen.summary(compiled.asm["ptx"])
        assert counts["ld.global.b16"] == 0 and counts["ld.global.v4.b32"] > 0, (name, counts)
    assert len(layouts["rms-norm"]) == 1 and layouts["rms-norm"] == layouts["rms-norm-fp8"], layouts
    assert "sizePerThread = [8]" in next(iter(layouts["rms-norm"]))


@pytest.mark.parametrize("name", ["moe-up-fp8", "moe-down-fp8"])
def test_the_fp8_experts_kernels_compile_to_fp8_mmas(name):
    """kernels/moe_few_rows.py's FP8 kernels compile for sm_90 and multiply on e4m3 warp-group MMAs. The CPU's
    other tests run them in Triton's interpreter, which took a helper that Triton's compiler refuses (two returns
    of two types: the FP8 experts fell back to torch on the GPU, 2026-12-07)."""
    counts = hopper_codegen.summary(hopper_codegen.compile_for_hopper(name).asm["ptx"])
    assert any(k.startswith("wgmma") and "e4m3.e4m3" in k for k in counts), counts
    assert counts["ld.global.b8"] == 0, counts                                   # tiles, not bytes



@pytest.mark.parametrize("name", ["moe-silu-scaled", "moe-sum-choices"])
def test_the_grouped_experts_row_kernels_compile_and_move_16_bytes_at_a_time(name):
    """kernels/moe_grouped.py's kernels compile for sm_90 (the CPU tests run them interpreted) and load their bf16
    rows in 16-byte vectors (one scalar load: silu's row scale): they exist to pass over the [S k] rows at the
    memory's rate."""
    counts = hopper_codegen.summary(hopper_codegen.compile_for_hopper(name).asm["ptx"])
    rows = 2 if name == "moe-silu-scaled" else 1                                 # gate and up; a choice's row
    assert counts["ld.global.b16"] <= rows - 1 and counts["ld.global.v4.b32"] >= rows, counts


def test_rope_with_the_head_norms_compiles_and_moves_16_bytes_at_a_time():
    """kernels/fused.py's RoPE with Qwen3's q/k head norms first compiles for sm_90 (the CPU tests run it
    interpreted), the heads' halves loaded and stored in 16-byte vectors."""
    ptx = hopper_codegen.compile_for_hopper("rope-head-norm").asm["ptx"]
    counts = hopper_codegen.summary(ptx)
    assert counts["ld.global.v4.b32"] > 0 and "st.global.v4.b32" in ptx, counts


def test_the_router_kernel_compiles_for_hopper():
    """kernels/moe_route.py's softmax and top k compile for sm_90 (the CPU tests run it interpreted), reading the
    logits as vectors, not one element at a time."""
    counts = hopper_codegen.summary(hopper_codegen.compile_for_hopper("moe-route").asm["ptx"])
    assert counts["ld.global.b16"] == 0 and counts["ld.global.v2.b32"] + counts["ld.global.v4.b32"] > 0, counts
