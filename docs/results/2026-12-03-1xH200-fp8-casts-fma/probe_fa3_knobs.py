"""Session probe (issue 53): FA3's FP8 forward at llama3-8b's shapes (causal square), pack_gqa left to FA3 /
forced on / off; ms a call (CUDA events, median of 5 after 2). python scripts/probe_fa3_knobs.py [tokens ...]"""
import os
import sys

import torch

from kernels.fa3_fp8 import _fa3_module, rotation, to_e4m3

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_gemm_shapes import timed  # noqa: E402

H, HKV, D = 32, 8, 128


def main(argv):
    f3 = _fa3_module()
    print("| tokens | pack_gqa | ms | TFLOP/s |\n|---|---|---|---|")
    for s in [int(a) for a in argv] or [8192, 131072]:
        qkv = torch.randn(s, H + 2 * HKV, D, device="cuda", dtype=torch.bfloat16)
        turn = rotation(D, torch.bfloat16, qkv.device)
        (q8, qd), (k8, kd), (v8, vd) = (to_e4m3(qkv[:, :H], HKV, turn), to_e4m3(qkv[:, H:H + HKV], HKV, turn),
                                        to_e4m3(qkv[:, H + HKV:], HKV))
        flop = 4 * D * H * s * (s + 1) / 2
        for pack in (None, True, False):
            ms = timed(lambda: f3.flash_attn_func(q8[None], k8[None], v8[None], softmax_scale=D ** -0.5 / D,
                                                  causal=True, q_descale=qd[None], k_descale=kd[None],
                                                  v_descale=vd[None], pack_gqa=pack, return_attn_probs=True),
                       iters=5, warmup=2) * 1e3
            print(f"| {s} | {pack} | {ms:.3f} | {flop / ms / 1e9:.0f} |", flush=True)
        del qkv, q8, k8, v8
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main(sys.argv[1:])
