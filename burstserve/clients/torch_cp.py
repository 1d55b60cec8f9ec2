"""PyTorch's own context parallelism, the peer in the prefill tables (issue 13): transformers'
LlamaForCausalLM (sdpa attention) on G GPUs, one process each, the prompt's sequence dimension sharded
by `torch.distributed.tensor.experimental.context_parallel` (ring attention inside SDPA, PyTorch's
default head-tail load balance), as a PyTorch user would run it (transformers' examples/pytorch/
context_parallel.py does the same for training):

    burstserve bench sweep --offline --sp-strategy torch-cp --model llama3-8b --devices cuda -cp 2

A request is the engine's first-token work: a prompt of random ids (the same on every rank) and its
positions, sharded as buffers, one forward pass with the logits of each rank's last position only, and
rank 0's greedy token on the host (head-tail balance gives rank 0 the prompt's last chunk). Rank 0
times it from a barrier to the token. TTFT only: PyTorch's context parallelism has no decode. CUDA only
(its context_parallel has no sharding rule for CPU attention); prompt lengths dividing by 2 x GPUs
(its load balancer's chunks). OOM is reported as OOM; a rank that dies
or a request that does not finish within `request_timeout` ends the sweep with an error row.
"""
import queue
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from burstserve.clients.hf_baseline import build_model
from burstserve.clients.server_process import free_port
from burstserve.clients.stats import RequestTiming
from burstserve.clients.sweep import default_label, make_row
from burstserve.engine.core.devices import resolve_devices
from burstserve.engine.core.errors import DeviceSpecError, InvalidRequestError


def check_torch_cp(devices: str | None, context_parallel_size: int | None, output_len: int = 1,
                   batch: int = 1, lengths: list[int] = ()) -> list[str]:
    """The GPUs torch-cp runs on; raises what a user asked that it cannot do."""
    if output_len != 1 or batch != 1:
        raise InvalidRequestError("--sp-strategy torch-cp measures the first token of one prompt (PyTorch's context "
                                  "parallelism has no decode): use --output-len 1 and --batch 1", "sp_strategy")
    device_list = resolve_devices(devices, context_parallel_size)
    if not all(d.startswith("cuda") for d in device_list):
        raise DeviceSpecError("--sp-strategy torch-cp needs CUDA GPUs: PyTorch's context_parallel has no sharding "
                              f"rule for attention on {device_list[0]}")
    uneven = [n for n in lengths if n % (2 * len(device_list))]
    if uneven:
        raise InvalidRequestError(f"--sp-strategy torch-cp over {len(device_list)} GPU(s) takes prompt lengths that "
                                  f"divide by {2 * len(device_list)} (PyTorch's load balancer cuts a prompt into "
                                  f"2 x GPUs equal chunks); not {uneven}", "lengths")
    return device_list


def sweep_torch_cp(model: str, devices: str | None, dtype: str | None, lengths: list[int], repeats: int,
                   warmup: int, label: str | None, progress, context_parallel_size: int | None = None,
                   output_len: int = 1, batch: int = 1, request_timeout: float = 900.0):
    """Yields the sweep's rows (bench sweep's `make_row`) for torch-cp over the GPUs named."""
    device_list = check_torch_cp(devices, context_parallel_size, output_len, batch, lengths)
    g = len(device_list)
    fields = {"strategy": "torch-cp", "devices": ",".join(device_list), "num_devices": g,
              "context_parallel_size": g, "kernel": "sdpa"}
    label = label or default_label(f"torch-cp, {g} GPU", batch)
    ranks = _Ranks(device_list, model, dtype, ("sweep", lengths, repeats, warmup))
    try:
        for n in lengths:
            msg = ranks.next(request_timeout * (repeats + warmup))
            if msg[0] == "row":
                _, _, warm, timed, peak, error = msg
            else:                                               # a rank failed or timed out
                warm, timed, peak, error = [], [], 0.0, msg[1]
            progress.update(len(warm) + len(timed) or repeats + warmup)
            as_batches = lambda ts: [[RequestTiming(0.0, [t])] for t in ts]   # noqa: E731
            yield make_row(label, fields, n, as_batches(timed), error, as_batches(warm), {"peak_memory_gib": peak},
                           output_len, batch)
            if error:
                break
    finally:
        ranks.stop()


def next_token_logits_torch_cp(model: str, devices: str | None, prompt: list[int], dtype: str | None = None,
                               context_parallel_size: int | None = None, timeout: float = 600.0) -> torch.Tensor:
    """The next-token logits [V] (fp32, CPU) after `prompt` through torch-cp on the GPUs named (for tests)."""
    ranks = _Ranks(check_torch_cp(devices, context_parallel_size, lengths=[len(prompt)]), model, dtype,
                   ("logits", prompt))
    try:
        msg = ranks.next(timeout)
    finally:
        ranks.stop()
    if msg[0] != "logits":
        raise RuntimeError(msg[1])
    return msg[1]


class _Ranks:
    """G processes, one per GPU, running `job`; rank 0's messages come back through a queue."""

    def __init__(self, devices: list[str], model: str, dtype: str | None, job: tuple):
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        port = free_port()
        self.procs = [ctx.Process(target=_rank_main, args=(r, devices, port, model, dtype, job, self.results),
                                  daemon=True, name=f"torch-cp-rank{r}") for r in range(len(devices))]
        for p in self.procs:
            p.start()

    def next(self, timeout: float) -> tuple:
        """Rank 0's next message, or ("error", why) when a rank died or nothing came within timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self.results.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in self.procs if p.exitcode not in (None, 0)]
                if dead:
                    return ("error", f"{dead[0].name} exited with code {dead[0].exitcode}")
        return ("error", f"timeout: no result within {timeout:.0f} s")

    def stop(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
            p.join(timeout=10)


def _rank_main(rank: int, devices: list[str], port: int, model: str, dtype: str | None, job: tuple, results) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    device = torch.device(devices[rank])
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=len(devices),
                            device_id=device)
    try:
        torch.manual_seed(0)                                     # a preset's random weights: alike on every rank
        lm = build_model(model, getattr(torch, dtype or "bfloat16"), device)
        mesh = init_device_mesh("cuda", (len(devices),))
        if job[0] == "logits":
            logits = _forward_last_logits(lm, mesh, torch.tensor([job[1]], device=device))
            if rank == 0:
                results.put(("logits", logits.float().cpu()))
        else:
            _sweep(lm, mesh, rank, *job[1:], results)
    except Exception as e:                                       # reported, then the parent ends the others
        results.put(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"))
    finally:
        dist.destroy_process_group()


def _sweep(lm, mesh, rank: int, lengths: list[int], repeats: int, warmup: int, results) -> None:
    for n in lengths:
        warm, timed, error = [], [], None
        torch.cuda.reset_peak_memory_stats()
        try:
            for i in range(warmup + repeats):
                (warm if i < warmup else timed).append(_first_token_seconds(lm, mesh, n, seed=i))
        except torch.cuda.OutOfMemoryError as e:
            error = f"{type(e).__name__} on rank {rank}: {e}"
        if rank == 0 or error:        # another rank's OOM is the row's too: rank 0 would wait in a collective
            results.put(("row", n, warm, timed, torch.cuda.max_memory_allocated() / 2**30, error))
        if error:
            return


def _first_token_seconds(lm, mesh, n: int, seed: int) -> float:
    """One request of n random ids (the same on every rank) -> rank 0's seconds from a barrier to its token."""
    ids = torch.randint(lm.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed * 7919 + n))
    ids = ids.to(lm.device)
    dist.barrier()
    torch.cuda.synchronize()
    start = time.perf_counter()
    _forward_last_logits(lm, mesh, ids).argmax().item()
    return time.perf_counter() - start


@torch.no_grad()
def _forward_last_logits(lm, mesh, ids: torch.Tensor) -> torch.Tensor:
    """ids [1, n] (the same on every rank) -> this rank's logits [V] of its last local position: on rank 0
    the prompt's last token (head-tail load balance puts the last chunk there)."""
    from torch.distributed.tensor.experimental import context_parallel
    positions = torch.arange(ids.shape[1], device=ids.device)[None]
    with context_parallel(mesh, buffers=[ids, positions], buffer_seq_dims=[1, 1], no_restore_buffers={ids, positions}):
        return lm(**causal_inputs(ids, positions), use_cache=False, logits_to_keep=1).logits[0, -1]


def causal_inputs(ids: torch.Tensor, positions: torch.Tensor) -> dict:
    """A rank's shard of the prompt as the model's inputs, attention left to SDPA's is_causal (which
    context_parallel shards). Head-tail balance gives a rank two runs of positions (rank 0 of 2: 0 .. n/4 - 1,
    then 3n/4 .. n - 1); with no attention mask transformers reads that jump as two packed sequences and
    builds a mask, which context_parallel's SDPA cannot shard. An all-ones padding mask says one sequence,
    unpadded, and transformers then drops the mask for is_causal."""
    return dict(input_ids=ids, position_ids=positions, attention_mask=torch.ones_like(ids))
