"""Where worker 0's host time goes between GPU calls: the scheduler loop under cProfile (engine/worker.py
`profiled`, BURSTSERVE_PROFILE_SCHEDULER), in two scenes on one GPU (llama3-8b preset, bf16):
- "decode": 16 streams of 8K-token prompts decoding 256 tokens;
- "interference": 8 streams of 1K decoding while a LONG-token prompt is chunked (--max-num-batched-tokens
  8192, --itl-target-ms 50), the streams running until it is done.
For each: wall time of the phase, the scheduler's iterations, and the functions by own time and by
cumulative time. The GPU waits show as the time in the calls that read results (`tolist`, `cpu`, `item`).
Usage: python scripts/gpu_scheduler_profile.py [LONG]   (LONG default 65536; prints markdown; a CPU dry run:
MODEL=tiny DEVICES=cpu ... 2048)."""
import io
import os
import pstats
import random
import sys
import tempfile
import threading
import time

SCENES = ("decode", "interference")


def run_scene(scene: str, long_len: int) -> str:
    path = tempfile.mktemp(suffix=f"-{scene}.prof")
    os.environ["BURSTSERVE_PROFILE_SCHEDULER"] = path
    from burstserve.engine import LLM, SamplingParams
    chunked = scene == "interference"
    llm = LLM(os.environ.get("MODEL", "llama3-8b"), devices=os.environ.get("DEVICES", "cuda"), max_num_seqs=16,
              max_model_len=long_len + 4096,
              max_num_batched_tokens=8192 if chunked else None, enable_chunked_prefill=chunked)
    rng = random.Random(0)
    vocab = llm.model_config.vocab_size
    prompt = lambda n: [rng.randrange(vocab) for _ in range(n)]          # noqa: E731
    start = time.perf_counter()
    if scene == "decode":
        llm.generate([prompt(int(os.environ.get("DECODE_LEN", 8192))) for _ in range(16)], SamplingParams(temperature=0, max_tokens=256, ignore_eos=True))
        detail = f"16 x {os.environ.get('DECODE_LEN', 8192)}-token prompts, 256 tokens each"
    else:
        done = threading.Event()
        params = SamplingParams(temperature=0, max_tokens=4096, ignore_eos=True)
        ids = [llm.submit(prompt(1024), params) for _ in range(8)]
        time.sleep(1.0)                                                  # the streams decoding
        t0 = time.perf_counter()
        long_id = llm.submit(prompt(long_len), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        ttft = None
        for item in llm.results(long_id):
            ttft = ttft or time.perf_counter() - t0
        done.set()
        for i in ids:
            llm.abort(i)
        detail = f"8 x 1K streams, a {long_len}-token prompt chunked: its TTFT {ttft:.3f} s"
    wall = time.perf_counter() - start
    stats = llm.stats
    llm.shutdown()
    for _ in range(100):                        # worker 0 writes the profile as it exits
        if os.path.exists(path):
            break
        time.sleep(0.1)
    text = io.StringIO()
    p = pstats.Stats(path, stream=text)
    p.sort_stats("tottime").print_stats(30)
    p.sort_stats("cumulative").print_stats(40)
    p.print_callees(r"decode_graphs.py.*\(run\)|model_runner.py.*\(decode\)|step_tokens.py.*\((sampled_result|keep)\)|worker_cache.py.*\(place_decode_tokens\)|"
                    r"kv_manager.py.*\(place\)|"
                    r"scheduler.py.*\((_decode|run)\)|inbox.py.*\(take\)|decode_steps.py.*\((run|finish|collect)\)")
    if os.environ.get("OUT"):
        os.replace(path, os.path.join(os.environ["OUT"], os.path.basename(path)))
    return (f"## {scene}: {detail}; wall {wall:.2f} s; scheduler stats {stats}\n\n```\n"
            f"{text.getvalue()}\n```\n")


if __name__ == "__main__":
    long_len = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
    for scene in os.environ.get("SCENES", " ".join(SCENES)).split():
        print(run_scene(scene, long_len), flush=True)
