"""The KV pool one GPU gets with default flags, per --kv-cache-dtype and --quantization: starts the engine (LLM)
with each and prints its worker's KV capacity in tokens (the longest prompt and its output together) and the
activations' row limit it found.

    [MODEL=llama3-8b] python scripts/gpu_kv_capacity.py [KV[:QUANT] ...]     default: auto fp8 (QUANT none)
    e.g. MODEL=qwen3-30b-a3b python scripts/gpu_kv_capacity.py auto auto:fp8 fp8:fp8
"""
import os
import sys

import torch

from burstserve.engine import LLM


def main(argv):
    model = os.environ.get("MODEL", "llama3-8b")
    print(f"{model} on {torch.cuda.get_device_name(0)}\n")
    print("| --kv-cache-dtype | --quantization | KV pool, tokens | prefill rows reserved |")
    print("|---|---|---|---|")
    for config in argv or ["auto", "fp8"]:
        kv, _, quant = config.partition(":")
        with LLM(model, devices="cuda:0", kv_cache_dtype=kv, quantization=quant or "none") as llm:
            facts = llm.worker_facts[0]
            rows = "any" if facts.prefill_rows_max is None else f"{facts.prefill_rows_max:,}"
            print(f"| {kv} | {quant or 'none'} | {facts.kv_capacity_tokens:,} | {rows} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
