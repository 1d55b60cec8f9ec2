"""The KV pool one GPU gets for the llama3-8b preset with default flags, per --kv-cache-dtype: starts the
engine (LLM) with each and prints its worker's KV capacity in tokens and the memory it found.

    python scripts/gpu_kv_capacity.py [auto fp8]
"""
import sys

import torch

from burstserve.engine import LLM


def main(argv):
    print("| --kv-cache-dtype | KV pool, tokens | GPU |")
    print("|---|---|---|")
    for kv in argv or ["auto", "fp8"]:
        with LLM("llama3-8b", devices="cuda:0", kv_cache_dtype=kv) as llm:
            capacity = llm.worker_facts[0].kv_capacity_tokens
            print(f"| {kv} | {capacity:,} | {torch.cuda.get_device_name(0)} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
