"""The KV host tier on one GPU (--kv-offload-gb, engine/pages/host_pool.py): what its copies cost, and what
decoding streams see while a document comes back from host memory.

    python scripts/gpu_host_tier.py copy                  host <-> GPU copies of llama3-8b pages through HostPool
    python scripts/gpu_host_tier.py streams [OPTIONS]     decode gaps of 8 streams while documents are restored

copy: a llama3-8b page pool (bf16 and FP8 pages) and a host tier; an entry of N tokens (pages in one run, and
pages scattered one by one) stored to host memory and loaded back, GB/s of each (CUDA events, median of 3).

streams: llama3-8b in this process (offline LLM), --documents documents of --doc-len tokens prefilled (each
with a 1-token answer) so that the GPU pool (--kv-cache-tokens) keeps only the last ones; then --streams
requests of 1024 tokens decode --stream-len tokens each while, every --gap seconds, a question (document +
512 tokens) about one of the first documents arrives: its prefix comes back from the host tier. Prints the
questions' TTFT and where their prefix came from, and the streams' inter-token gaps: all of them, and those
that overlap a question's [arrival, first token] window (p50 / p99 / max ms). Writes host_tier_streams.json
under $OUT (or the working directory).
"""
import argparse
import json
import os
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_kernel_timing import timed  # noqa: E402


def _median_seconds(fn) -> float:
    """Median of 3 timed calls after one (scripts/gpu_kernel_timing.py's CUDA-event timing)."""
    return timed(fn, iters=3, warmup=1)


def copy_table(tokens_list: list[int]) -> list[dict]:
    """Store and load GB/s of an entry of each size, pages in one run and scattered, bf16 and FP8 pages."""
    from burstserve.engine.pages.host_pool import HostPool
    from burstserve.engine.pages.page_pool import PagePool
    rows = []
    for kv in ("auto", "fp8"):
        pages = max(tokens_list) // 128
        pool = PagePool(32, 2 * pages + 1, 128, 8, 128, torch.bfloat16, torch.device("cuda"), max_seqs=4,
                        max_pages_per_seq=2 * pages + 1, kv_cache_dtype=kv)
        start = time.perf_counter()
        host = HostPool(pool, pages)
        pin_seconds = time.perf_counter() - start
        for tokens in tokens_list:
            for layout in ("one run", "scattered"):
                n = tokens // 128
                pool.add(1, 0)
                pool.pages[1] = list(range(1, n + 1)) if layout == "one run" else list(range(1, 2 * n + 1, 2))
                pool.lengths[1] = tokens
                pool.add(2, 0)
                pool.pages[2] = list(range(2 * n + 1, 2 * n + 1 - n, -1)) if layout == "scattered" else \
                    list(range(n + 1, 2 * n + 1))
                pool.lengths[2] = tokens

                def store():
                    host.free(9)
                    host.store(pool, 1, 9, tokens)
                    host.store_stream.synchronize()

                def load():
                    host.load(pool, 9, 2, tokens)
                    host.load_stream.synchronize()

                store()
                nbytes = n * host.page_bytes
                rows.append({"kv": kv, "tokens": tokens, "layout": layout, "bytes": nbytes,
                             "store_GBps": nbytes / _median_seconds(store) / 1e9,
                             "load_GBps": nbytes / _median_seconds(load) / 1e9, "pin_seconds": pin_seconds})
                host.free(9)
                pool.pages[1] = pool.pages[2] = []
                pool.free(1)
                pool.free(2)
                print(f"| {kv} | {tokens} | {layout} | {nbytes / 2**30:.2f} | {rows[-1]['store_GBps']:.1f} | "
                      f"{rows[-1]['load_GBps']:.1f} |", flush=True)
        host.release()
        host = pool = None
        torch.cuda.empty_cache()
    return rows


def streams_run(args) -> dict:
    """The decode gaps of --streams streams while questions restore documents from the host tier."""
    import random
    from burstserve.engine import LLM, SamplingParams
    rng = random.Random(0)
    llm = LLM("llama3-8b", devices="cuda", kv_cache_dtype=args.kv_cache_dtype, kv_offload_gb=args.kv_offload_gb,
              kv_cache_tokens=args.kv_cache_tokens, max_model_len=args.doc_len + 4096, mixed_batch=args.mixed_batch)
    vocab = llm.model_config.vocab_size
    docs = [[rng.randrange(vocab) for _ in range(args.doc_len)] for _ in range(args.documents)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    started = time.perf_counter()
    for doc in docs:
        llm.generate(doc + [rng.randrange(vocab) for _ in range(16)], one)
    prefill_seconds = time.perf_counter() - started
    times: dict[str, list[float]] = {}
    done = threading.Event()
    left = [args.streams]

    def sink(item):
        if isinstance(item, BaseException):
            done.set()
            return
        times.setdefault(item.request_id, []).append(item.time)
        if item.finish_reason is not None:
            left[0] -= 1
            if not left[0]:
                done.set()

    params = SamplingParams(temperature=0, max_tokens=args.stream_len, ignore_eos=True)
    for i in range(args.streams):
        llm.submit([rng.randrange(vocab) for _ in range(1024)], params, f"stream-{i}", sink=sink)
    time.sleep(args.gap)
    windows, questions = [], []
    for d in range(args.questions):
        question = docs[d % args.documents] + [rng.randrange(vocab) for _ in range(512)]
        arrived = time.time()
        out = llm.generate(question, one)[0]
        stats = out.metrics.prefill_stats
        first = out.metrics.first_token_time
        windows.append((arrived, first))
        questions.append({"document": d % args.documents, "ttft_s": first - arrived,
                          "cached_tokens": (stats.cached_tokens or 0),
                          "host_cached_tokens": (stats.host_cached_tokens or 0),
                          "restore_seconds": stats.restore_seconds, "chunks": stats.chunks,
                          "mixed_chunks": stats.mixed_chunks, "smallest_chunk": stats.smallest_chunk,
                          "largest_chunk": stats.largest_chunk})
        print(f"question {d}: TTFT {first - arrived:.3f} s, cached {questions[-1]['cached_tokens']}, from host "
              f"{questions[-1]['host_cached_tokens']}, restore {questions[-1]['restore_seconds']}, chunks "
              f"{questions[-1]['chunks']} ({questions[-1]['mixed_chunks']} with a decode step, "
              f"{questions[-1]['smallest_chunk']}-{questions[-1]['largest_chunk']} tokens)", flush=True)
        if left[0] == 0:
            break
        time.sleep(args.gap)
    done.wait(timeout=600)
    llm.shutdown()
    gaps, during = [], []
    for ts in times.values():
        for a, b in zip(ts, ts[1:]):
            gaps.append(b - a)
            if any(a < end and b > start for start, end in windows):
                during.append(b - a)
    longest = sorted(during, reverse=True)[:8]
    print("longest gaps overlapping a question, ms: " + ", ".join(f"{g * 1e3:.1f}" for g in longest), flush=True)
    return {"kv_cache_dtype": args.kv_cache_dtype, "kv_offload_gb": args.kv_offload_gb,
            "kv_cache_tokens": args.kv_cache_tokens, "documents": args.documents, "doc_len": args.doc_len,
            "prefill_seconds": prefill_seconds, "questions": questions, "gaps_all": _ms(gaps),
            "gaps_during_restore": _ms(during), "gpu": torch.cuda.get_device_name(0)}


def _ms(gaps: list[float]) -> dict:
    from burstserve.clients.stats import percentile
    s = sorted(g * 1e3 for g in gaps)
    if not s:
        return {"count": 0}
    return {"count": len(s), "p50_ms": percentile(s, 50), "p99_ms": percentile(s, 99), "max_ms": s[-1]}


def main(argv):
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["copy", "streams"])
    ap.add_argument("--tokens", default="8192,131072", help="copy: entry sizes")
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--kv-offload-gb", type=float, default=48)
    ap.add_argument("--kv-cache-tokens", type=int, default=262144)
    ap.add_argument("--documents", type=int, default=4)
    ap.add_argument("--doc-len", type=int, default=131072)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-len", type=int, default=1500)
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--gap", type=float, default=1.0)
    ap.add_argument("--mixed-batch", action="store_true", default=None,
                    help="streams: every chunk after a prompt's first runs with the decode step (eagerly)")
    args = ap.parse_args(argv)
    out = os.environ.get("OUT", ".")
    print(f"GPU: {torch.cuda.get_device_name(0)}")
    if args.what == "copy":
        print("| pages | tokens | layout | GiB | store GB/s | load GB/s |\n|---|---|---|---|---|---|")
        rows = copy_table([int(t) for t in args.tokens.split(",")])
        with open(os.path.join(out, "host_tier_copy.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return
    result = streams_run(args)
    print(json.dumps({k: v for k, v in result.items() if k != "questions"}, indent=1))
    with open(os.path.join(out, f"host_tier_streams_{args.kv_cache_dtype}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
