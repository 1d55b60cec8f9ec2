"""What Triton makes of the FP8 kernels (paged decode, the few-rows GEMM, the row kernels, fa3-fp8's casts) for a
Hopper GPU (sm_90), compiled on this machine: no GPU needed, only Triton (its CUDA backend and ptxas ship in the
wheel). For each kernel and launch, the PTX instructions that decide its speed, counted over the whole kernel:

    global loads   ld.global.* by width (b8: a byte at a time, what unaligned K/V tiles come to)
    async copies   cp.async.* (the software pipeline's copies into shared memory)
    shared memory  ld.shared / st.shared by width (b8 stores: a byte-wise transpose), ldmatrix
    MMAs           mma.sync (Ampere's) and wgmma (Hopper's, with their operand types)
    conversions    cvt e4m3 <-> f16 / f32

    python scripts/hopper_codegen.py [decode|small-gemm|silu-and-mul-fp8|rms-norm|rms-norm-fp8|fa3-amax|fa3-cast|
                                      moe-up-fp8|moe-down-fp8|moe-silu-scaled|moe-sum-choices|moe-route|rope-head-norm ...]
        default: all; PTX written under $OUT (or .)

The arguments are specialized as a launch from the engine specializes them: every pointer 16-byte aligned,
and the integer arguments that are not in the kernel's do_not_specialize list divisible by 16 where the
engine's values are (llama3-8b's shapes: 32 query heads, 8 KV heads, d 128, pages of 128). Triton's version
matters: the GPU image's is in ../shared/gpu/README.md; this prints the one it ran with. Why it exists:
docs/results/log.md, "FP8 pages: the decode kernel's scales asked for a tile ahead (issue 35)".
"""
import collections
import inspect
import os
import re
import sys

import triton
from triton.backends.compiler import GPUTarget

from burstserve.kernels import fa3_fp8
from burstserve.kernels import fp8_paged_attention as fpa
from burstserve.kernels import fp8_small_gemm as sg
from burstserve.kernels import fused
from burstserve.kernels import moe_few_rows as mfr
from burstserve.kernels import moe_grouped as mg
from burstserve.kernels import moe_route as mr

H, HKV, D, BS = 32, 8, 128, 128
QKV_ROW = (H + 2 * HKV) * D                     # a token's row of the fused QKV output (q's token stride)

DECODE_ARGS = [("q_ptr", "*bf16", None), ("k_ptr", "*u8", None), ("v_ptr", "*u8", None), ("ks_ptr", "*bf16", None),
               ("vs_ptr", "*bf16", None), ("table_ptr", "*i32", None), ("lens_ptr", "*i32", None),
               ("out_ptr", "*fp32", None), ("lse_ptr", "*fp32", None), ("scale2", "fp32", None),
               ("table_stride", "i32", 1025), ("splits", "i32", 49), ("q_stride_b", "i32", QKV_ROW),
               ("q_stride_h", "i32", D), ("batch", "i32", 1)]
# the few-rows FP8 GEMM on llama3-8b's o projection (K 4096), 16 rows (a 16-sequence decode step)
GEMM_ARGS = [("x_ptr", "*u8", None), ("xs_ptr", "*fp32", None), ("w_ptr", "*u8", None), ("ws_ptr", "*fp32", None),
             ("bias_ptr", "*fp32", None), ("out_ptr", "*bf16", None), ("part_ptr", "*fp32", None),
             ("M", "i32", 16), ("N", "i32", 4096), ("K", "i32", 4096), ("x_stride", "i32", 4096),
             ("w_stride", "i32", 4096), ("k_per_run", "i32", 1024)]


def _defaults(launcher) -> dict:
    """A launcher's keyword defaults (the launch settings the engine uses), so this follows them."""
    return {k: p.default for k, p in inspect.signature(launcher).parameters.items() if p.default is not p.empty}


_DEC = _defaults(fpa._decode_triton)
_GEMM = _defaults(sg._launch)
_GEMM_CONSTS = dict(HAS_BIAS=False, SPLIT=True, BLOCK_M=16, BLOCK_N=_GEMM["block_n"], BLOCK_K=_GEMM["block_k"],
                    STAGES=_GEMM["stages"])
# silu * up quantized per row, llama3-8b's 8K-token prefill (intermediate 14336; gate_up rows of 28672)
SILU_FP8_ARGS = [("x_ptr", "*bf16", None), ("q_ptr", "*fp8e4nv", None), ("scale_ptr", "*fp32", None),
                 ("inter", "i32", 14336), ("x_stride", "i32", 28672)]
# the two norms on llama3-8b's hidden rows (4096), the residual added: rms_norm writes bf16, rms_norm_fp8 e4m3
_NORM_HEAD = [("x_ptr", "*bf16", None), ("res_ptr", "*bf16", None), ("w_ptr", "*bf16", None)]
_NORM_TAIL = [("n", "i32", 4096), ("x_stride", "i32", 4096), ("res_stride", "i32", 4096), ("eps", "fp32", None)]
NORM_ARGS = _NORM_HEAD + [("out_ptr", "*bf16", None), ("res_out_ptr", "*bf16", None)] + _NORM_TAIL
NORM_FP8_ARGS = _NORM_HEAD + [("q_ptr", "*fp8e4nv", None), ("scale_ptr", "*fp32", None),
                              ("res_out_ptr", "*bf16", None)] + _NORM_TAIL
# fa3-fp8's casts of q (an 8K prefill's rows of the fused QKV), turned by the rotation: the group maxima, the cast
_CAST_HEAD = [("x_ptr", "*bf16", None), ("turn_ptr", "*bf16", None), ("amax_ptr", "*i32", None)]
_CAST_TAIL = [("s", "i32", 8192), ("row_stride", "i32", QKV_ROW), ("blocks", "i32", 512)]
AMAX_ARGS = _CAST_HEAD + _CAST_TAIL
CAST_ARGS = _CAST_HEAD + [("descale_ptr", "*fp32", None), ("out_ptr", "*u8", None)] + _CAST_TAIL + [
    ("min_scale", "fp32", None)]
_CAST_CONSTS = dict(G=H // HKV, GPAD=H // HKV, D=D, DPAD=D, ROWS=fa3_fp8.CAST_TILE // (H // HKV * D), ROTATE=True,
                    INTERPRETED=False)
# the few-rows experts' kernels, FP8 (-q fp8), on Qwen3-30B-A3B's shapes (hidden 2048, expert width 768, top 8 of
# 128) at one decode row: its 8 experts' programs, by slot
_MOE = _defaults(mfr._launch)
_MOE_CONSTS = dict(TOP_K=8, BY_SLOT=True, BLOCK_M=16, BLOCK_MK=16, BLOCK_TOPK=8, PRECISION="tf32", FP8=True,
                   INTERPRETED=False, BLOCK_N=64, BLOCK_K=_MOE["block_k"], STAGES=_MOE["stages"])
MOE_UP_ARGS = [("x_ptr", "*u8", None), ("xs_ptr", "*fp32", None), ("gu_ptr", "*u8", None), ("gus_ptr", "*fp32", None),
               ("chosen_ptr", "*i64", None), ("act_ptr", "*bf16", None), ("M", "i32", 1), ("HID", "i32", 2048),
               ("IM", "i32", 768), ("x_stride", "i32", 2048)]
MOE_DOWN_ARGS = [("act_ptr", "*u8", None), ("as_ptr", "*fp32", None), ("down_ptr", "*u8", None),
                 ("ds_ptr", "*fp32", None), ("chosen_ptr", "*i64", None), ("w_ptr", "*fp32", None),
                 ("y_ptr", "*fp32", None), ("M", "i32", 1), ("HID", "i32", 2048), ("IM", "i32", 768)]
# the grouped experts' elementwise kernels (kernels/moe_grouped.py) on Qwen3-30B-A3B's shapes: a 16,384-row piece's
# sorted choices (top 8), expert width 768, hidden 2048
MOE_SILU_ARGS = [("up_ptr", "*bf16", None), ("scale_ptr", "*bf16", None), ("out_ptr", "*bf16", None),
                 ("inter", "i32", 768)]
MOE_SUM_ARGS = [("y_ptr", "*bf16", None), ("slot_ptr", "*i64", None), ("out_ptr", "*bf16", None),
                ("hidden", "i32", 2048)]
# the router's softmax and top 8 of 128 experts (kernels/moe_route.py), a decode step's or a prefill's rows
MOE_ROUTE_ARGS = [("logits_ptr", "*bf16", None), ("w_ptr", "*bf16", None), ("chosen_ptr", "*i64", None),
                  ("S", "i32", None), ("E", "i32", 128), ("stride", "i32", 128)]
# RoPE with Qwen3's q/k head norms first, inside a token's fused QKV row (Qwen3-30B-A3B: 32 query heads, 4 KV heads,
# d 128)
ROPE_NORM_ARGS = [("qkv_ptr", "*bf16", None), ("cos_ptr", "*bf16", None), ("sin_ptr", "*bf16", None),
                  ("qw_ptr", "*bf16", None), ("kw_ptr", "*bf16", None), ("row_stride", "i32", (32 + 2 * 4) * 128),
                  ("cs_stride", "i32", 128), ("num_q", "i32", 32), ("num_rot", "i32", 36), ("eps", "fp32", None)]
# name: (module, kernel key, [(argument, Triton type, engine value or None)], constexprs, warps, stages)
LAUNCHES = {
    "decode": (fpa, "decode", DECODE_ARGS,
               dict(HKV=HKV, QPK=H // HKV, QPAD=fpa.QPAD_MIN, D=D, BS=BS, STAGES=_DEC["num_stages"],
                    BN=min(_DEC["block_keys"], BS)), _DEC["num_warps"], _DEC["num_stages"]),
    "silu-and-mul-fp8": (fused, "silu_and_mul_fp8", SILU_FP8_ARGS, dict(BLOCK=16384), fused._row_warps(16384), 1),
    "rms-norm": (fused, "rms_norm", NORM_ARGS, dict(HAS_RES=True, BLOCK=4096), fused._row_warps(4096), 1),
    "rms-norm-fp8": (fused, "rms_norm_fp8", NORM_FP8_ARGS, dict(HAS_RES=True, BLOCK=4096), fused._row_warps(4096), 1),
    "small-gemm": (sg, "gemm", GEMM_ARGS, _GEMM_CONSTS, _GEMM["warps"], _GEMM["stages"]),
    "fa3-amax": (fa3_fp8, "amax", AMAX_ARGS, _CAST_CONSTS, 4, 3),
    "fa3-cast": (fa3_fp8, "cast", CAST_ARGS, _CAST_CONSTS, 4, 3),
    "moe-up-fp8": (mfr, "gate_up", MOE_UP_ARGS, _MOE_CONSTS, _MOE["warps"], _MOE["stages"]),
    "moe-down-fp8": (mfr, "down", MOE_DOWN_ARGS, _MOE_CONSTS, _MOE["warps"], _MOE["stages"]),
    "rope-head-norm": (fused, "rope", ROPE_NORM_ARGS, dict(D=128, HALF=64, HEADS_PAD=64, NORM=True), 4, 1),
    "moe-silu-scaled": (mg, "silu_mul_scaled", MOE_SILU_ARGS, dict(BLOCK=mg.BLOCK), 4, 1),
    "moe-sum-choices": (mg, "sum_choices", MOE_SUM_ARGS, dict(K=8, BLOCK=mg.BLOCK, SLOTS=True), 4, 1),
    "moe-route": (mr, "route", MOE_ROUTE_ARGS, dict(ROWS=mr.ROWS, BLOCK_E=128, K=8, BLOCK_K=8, RENORMALIZE=True,
                                                   INTERPRETED=False), 4, 1),
}
PATTERN = re.compile(r"\b(ld\.global[\w.]*|cp\.async\.(?:ca|cg|bulk)[\w.:]*|ld\.shared[\w.]*|st\.shared[\w.]*|"
                     r"ldmatrix[\w.]*|mma\.sync[\w.]*|wgmma\.mma_async[\w.]*|cvt[\w.]*e4m3[\w.]*)")


def compile_for_hopper(name: str):
    """One launch of LAUNCHES compiled for sm_90 -> Triton's compiled kernel (PTX in .asm["ptx"])."""
    module, key, args, constexprs, warps, stages = LAUNCHES[name]
    kernel = module._build()[key]
    nospec = {kernel.arg_names[a] if isinstance(a, int) else a for a in kernel.do_not_specialize}
    # an integer argument equal to 1 becomes a constant, as Triton's launcher specializes it
    ones = {a: 1 for a, t, value in args if value == 1 and a not in nospec}
    constexprs = dict(constexprs, **ones)
    signature = {a: t for a, t, _ in args}
    signature.update({c: "constexpr" for c in constexprs})
    attrs = {}
    for i, (a, t, value) in enumerate(args):
        if a not in ones and (t.startswith("*") or (value is not None and a not in nospec and value % 16 == 0)):
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = triton.compiler.ASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def summary(ptx: str) -> collections.Counter:
    return collections.Counter(m.group(1) for m in PATTERN.finditer(ptx))


def main(argv: list[str]) -> None:
    names = argv or list(LAUNCHES)
    out = os.environ.get("OUT", ".")
    print(f"Triton {triton.__version__}, target sm_90")
    for name in names:
        compiled = compile_for_hopper(name)
        ptx = compiled.asm["ptx"]
        with open(os.path.join(out, f"{name}.ptx"), "w") as f:
            f.write(ptx)
        counts = summary(ptx)
        print(f"\n{name}: shared memory {compiled.metadata.shared} bytes")
        print("| instruction | count |\n|---|---|")
        for instr, n in sorted(counts.items()):
            print(f"| {instr} | {n} |")


if __name__ == "__main__":
    main(sys.argv[1:])
