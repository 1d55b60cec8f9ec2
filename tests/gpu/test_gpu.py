"""GPU checks, run on the H200 machines with `pytest -m gpu tests/gpu` (CI has no GPU and deselects them).

Kernels against the fp32 reference, the NCCL ring against one-device attention, and the engine in
bf16 on 2 GPUs against transformers on one GPU."""
import contextlib
import math
import random
import time

import pytest
import torch

from burstserve.kernels.attention import AttentionBackend, _GPU_BACKENDS, available_backends, reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["cudnn", "flash"])
@pytest.mark.parametrize("causal", [True, False])
def test_gpu_kernel_matches_reference(name, causal):
    dev = torch.device("cuda:0")
    q = torch.randn(1000, 32, 128, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(1000, 2, 8, 128, device=dev, dtype=torch.bfloat16)
    out, lse = AttentionBackend(name, _GPU_BACKENDS[name])(q, kv[:, 0], kv[:, 1], causal, 128 ** -0.5)
    ref_out, ref_lse = reference_attention(q, kv[:, 0], kv[:, 1], causal, 128 ** -0.5)
    assert (out.float() - ref_out.float()).abs().max() < 2e-2
    assert (lse - ref_lse).abs().max() < 1e-3


def test_auto_backend_prefers_flash_attn_4_then_cudnn():
    """flash-attn-4 first on SM90+ when it imports; cuDNN first otherwise."""
    import importlib.util
    order = available_backends(torch.device("cuda:0"))
    has_fa4 = importlib.util.find_spec("flash_attn") is not None and importlib.util.find_spec("flash_attn.cute")
    sm90 = torch.cuda.get_device_capability(0) >= (9, 0)
    assert order[0] == ("flash_attn_4" if has_fa4 and sm90 else "cudnn")
    assert "cudnn" in order


def _nccl_ring_rank(rank, world, port, seq_len, seed, out_q):
    import torch.distributed as dist
    from burstserve.engine.parallel.burst_attention import BurstAttention
    from burstserve.engine.parallel.ring import RingCommunicator
    from burstserve.engine.core.placement import zigzag_shards
    from burstserve.kernels.attention import select_backend
    dev = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(seq_len, 32, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(seq_len, 2, 8, 128, device=dev, dtype=torch.bfloat16, generator=gen)
    shards = zigzag_shards(seq_len, world)
    pos = shards[rank].positions(dev)
    backend = select_backend(dev, torch.bfloat16, 32, 8, 128)
    ring = RingCommunicator(rank, world, dev)
    out, lse = BurstAttention(ring, backend, shards, rank, 128 ** -0.5).forward(q[pos], kv[pos].contiguous())
    ref_out, ref_lse = backend(q, kv[:, 0], kv[:, 1], True, 128 ** -0.5)
    err = ((out.float() - ref_out[pos].float()).abs().max().item(), (lse - ref_lse[pos]).abs().max().item())
    stats = ring.collect_stats()
    out_q.put((rank, err, stats.exchanges, backend.name))
    dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("seq_len", [4099, 65536])
def test_nccl_ring_matches_one_device(seq_len):
    import torch.multiprocessing as mp
    from dist_harness import _free_port as free_port
    world = min(torch.cuda.device_count(), 4)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port, seed = free_port(), random.randrange(1 << 30)   # one seed: every rank draws the same q, k, v
    procs = [ctx.Process(target=_nccl_ring_rank, args=(r, world, port, seq_len, seed, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    for rank, (out_err, lse_err), exchanges, name in results:
        assert out_err < 2e-2 and lse_err < 2e-3, (rank, out_err, lse_err, name)
        assert exchanges == world - 1


@pytest.fixture(scope="module")
def hf_bf16_checkpoint(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM
    path = str(tmp_path_factory.mktemp("llama3-bf16"))
    cfg = LlamaConfig(vocab_size=2000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=16384,
                      rope_theta=500000.0, initializer_range=0.05,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 1024})
    torch.manual_seed(random.randrange(1 << 30))
    LlamaForCausalLM(cfg).save_pretrained(path)
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16, attn_implementation="sdpa")
    return path, model.to("cuda:0").eval()


def tie_tolerance(top_logit: float) -> float:
    """A top-2 margin under which two correct bf16 implementations may pick either token: 0.1 of
    noise plus two roundings of the bf16 logit itself (both round their logits to bf16)."""
    return 0.1 + 2 * 2 ** (math.floor(math.log2(max(abs(top_logit), 1e-3))) - 7)


@torch.no_grad()
def _hf_greedy(model, prompt, n, with_scales=False):
    out = model(torch.tensor([prompt], device="cuda:0"), use_cache=True, logits_to_keep=1)
    first = out.logits[0, -1].float().cpu()
    past, tokens, margins, scales = out.past_key_values, [], [], []
    logits = first
    for _ in range(n):
        top2 = torch.topk(logits, 2).values
        margins.append(float(top2[0] - top2[1]))
        scales.append(float(top2[0]))
        tokens.append(int(logits.argmax()))
        if len(tokens) == n:
            break
        out = model(torch.tensor([[tokens[-1]]], device="cuda:0"), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float().cpu()
    return (first, tokens, margins, scales) if with_scales else (first, tokens, margins)


def _gpu_backends() -> list[str]:
    """--attention-backend values that can run here: flash-attn (when flash-attn-4 imports) and cudnn."""
    from burstserve.kernels.attention import backend_refusal
    return [b for b in ("flash-attn", "cudnn") if backend_refusal(b, ["cuda:0"]) is None]


@pytest.mark.parametrize("backend", ["flash-attn", "cudnn"])
def test_engine_bf16_on_one_gpu_matches_transformers_with_each_backend(hf_bf16_checkpoint, backend):
    """The engine with --attention-backend flash-attn and cudnn on one GPU: logits and greedy tokens
    agree with transformers (bf16 noise); a backend that cannot run here is refused at start."""
    from burstserve.engine import LLM, DeviceSpecError, SamplingParams
    path, model = hf_bf16_checkpoint
    if backend not in _gpu_backends():
        with pytest.raises(DeviceSpecError, match=f"--attention-backend {backend}"):
            LLM(path, devices="cuda:0", dtype="bfloat16", attention_backend=backend)
        pytest.skip(f"{backend} cannot run here (refused cleanly)")
    noise = 0.1
    prompts = [[random.randrange(2000) for _ in range(n)] for n in (3, 1000, 8191)]
    with LLM(path, devices="cuda:0", dtype="bfloat16", attention_backend=backend) as llm:
        assert llm.kernel == {"flash-attn": "flash_attn_4"}.get(backend, backend)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            ref_logits, ref_tokens, margins, scales = _hf_greedy(model, prompt, 16, with_scales=True)
            diff = (llm.next_token_logits(prompt) - ref_logits).abs().max().item()
            print(f"{backend} bf16 prompt {len(prompt)}: max |logit diff| {diff:.4f}")
            assert diff <= noise * max(ref_logits.abs().max().item(), 1.0), len(prompt)
            for i, (a, b) in enumerate(zip(out.outputs[0].token_ids, ref_tokens)):
                if a != b:
                    assert margins[i] < tie_tolerance(scales[i]), (len(prompt), i, margins[i], scales[i])
                    break


@pytest.mark.parametrize("devices,ring_min,extend_pass", [("cuda:0", 4096, "q"), ("cuda:0,1", 4096, "q"),
                                                         ("cuda:0,1", 0, "q"), ("cuda:0,1", 0, "kv"),
                                                         ("cuda:0,1,2,3", 0, "kv")])
def test_chunks_and_prefix_extensions_match_transformers(hf_bf16_checkpoint, devices, ring_min, extend_pass):
    """Incremental prefills: a 5000-token prompt in chunks of 1024, then prompts that extend it (cache hit
    inside a page, on a page boundary) give transformers' next-token logits (bf16 noise). One GPU: one
    causal paged call per layer over the cached and new keys ("local"); two: the new tokens run whole on
    both GPUs, one keeping their K/V (ring_min 4096), or over the K/V ring (ring_min 0) with the queries
    passed to the cache (extend_pass q) or the cached K/V passed with the new (kv); four: pass-KV with each
    step's merges queued after the next exchange (PassKVAttention)."""
    from burstserve.engine import LLM
    gpus = len(devices.split(","))
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    path, model = hf_bf16_checkpoint
    prompt = [random.randrange(2000) for _ in range(5000)]
    extended = [prompt + [random.randrange(2000) for _ in range(n)] for n in (700, 3)]
    with LLM(path, devices=devices, dtype="bfloat16", max_num_batched_tokens=1024,
             extend_ring_min_tokens=ring_min, extend_pass=extend_pass) as llm:
        for p in [prompt] + extended + [prompt[:4096] + [7] * 300]:
            logits = llm.next_token_logits(p)
            ref = model(torch.tensor([p], device="cuda:0"), logits_to_keep=1).logits[0, -1].float().cpu()
            diff = (logits - ref).abs().max().item()
            print(f"extend on {devices} (ring from {ring_min} tokens, pass {extend_pass}), prompt {len(p)}: "
                  f"max |logit diff| {diff:.4f}")
            assert diff <= 0.1 * max(ref.abs().max().item(), 1.0), len(p)


def test_chunked_prefill_pool_holds_a_prompt_the_one_call_pool_refuses(hf_bf16_checkpoint):
    """Pool sizing with chunked prefill on flash-attn-4 (engine/pages/sizing.py): at the same
    --gpu-memory-utilization (set here so that ~1 GB is left after the worker's weights and context) and a
    long max_model_len, the one-call engine reserves a whole prompt's activations and the chunked one a
    chunk's, so its pool is several times larger; a prompt past the first pool's capacity is refused there
    and served in chunks by the second with transformers' logits and greedy tokens (bf16 noise); with
    prompt_logprobs the same prompt is refused, by name."""
    from burstserve.engine import LLM, InvalidRequestError, SamplingParams
    from burstserve.kernels.paged_attention import fa4_available
    if not fa4_available(torch.device("cuda:0")):
        pytest.skip("needs flash-attn-4 (without it attention gathers the cache and the whole share stays reserved)")
    path, model = hf_bf16_checkpoint
    free, total = torch.cuda.mem_get_info(0)
    utilization = (total - free + 1.5 * 2**30) / total
    options = dict(devices="cuda:0", dtype="bfloat16", max_model_len=262144, gpu_memory_utilization=utilization)
    with LLM(path, enable_chunked_prefill=False, **options) as llm:
        one_call = llm.kv_capacity_tokens
        prompt = [random.randrange(2000) for _ in range(one_call + 2048)]
        with pytest.raises(InvalidRequestError, match="more than the engine's capacity"):
            llm.generate(prompt, SamplingParams(max_tokens=8))
    with LLM(path, max_num_batched_tokens=2048, **options) as llm:
        chunked = llm.kv_capacity_tokens
        print(f"KV pool at gpu_memory_utilization {utilization:.4f}: {one_call} tokens in one call, {chunked} "
              f"with chunks of 2048 (activations for {llm.worker_facts[0].prefill_rows_max} tokens)")
        assert chunked > 4 * one_call
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
        logits = llm.next_token_logits(prompt)
        with pytest.raises(InvalidRequestError, match="prompt_logprobs needs the prompt prefilled in one call"):
            llm.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0))
    ref_logits, ref_tokens, margins, scales = _hf_greedy(model, prompt, 8, with_scales=True)
    diff = (logits - ref_logits).abs().max().item()
    print(f"chunked prompt of {len(prompt)} tokens: max |logit diff| {diff:.4f}")
    assert diff <= 0.1 * max(ref_logits.abs().max().item(), 1.0)
    for i, (a, b) in enumerate(zip(out.outputs[0].token_ids, ref_tokens)):
        if a != b:
            assert margins[i] < tie_tolerance(scales[i]), (i, margins[i], scales[i])
            break


@pytest.mark.parametrize("devices", ["cuda:0", "cuda:0,1"])
def test_small_extends_in_cuda_graphs_match_eager_and_transformers(hf_bf16_checkpoint, devices):
    """engine/runner/extend_graphs.py: a 3000-token prompt in chunks of 256 and 384 (each chunk after the first
    replays a graph: one GPU "local", two "whole") and a 300-token question after it (the prefix cache's
    extend, padded to the 384-row graph) give transformers' next-token logits (bf16 noise) and the eager
    extend's (cuda_graphs=False) within bf16 noise."""
    from burstserve.engine import LLM, SamplingParams
    from burstserve.kernels.paged_attention import fa4_available
    if torch.cuda.device_count() < len(devices.split(",")):
        pytest.skip("needs 2 GPUs")
    if not fa4_available(torch.device("cuda:0")):
        pytest.skip("extend CUDA graphs need flash-attn-4")
    path, model = hf_bf16_checkpoint
    prompt = [random.randrange(2000) for _ in range(3000)]
    question = prompt + [random.randrange(2000) for _ in range(300)]
    results = {}
    for graphs in (True, False):
        for chunk in (256, 384):
            with LLM(path, devices=devices, dtype="bfloat16", max_num_batched_tokens=chunk, itl_target_ms=None,
                     cuda_graphs=graphs) as llm:
                out = llm.generate(prompt, SamplingParams(max_tokens=1))[0]
                stats = out.metrics.prefill_stats
                assert stats.graphed_extends == (stats.chunks - 1 if graphs else 0), stats
                results[graphs, chunk] = [llm.next_token_logits(prompt)]
                asked = llm.generate(question, SamplingParams(max_tokens=1))[0].metrics.prefill_stats
                assert asked.cached_tokens > 0 and asked.graphed_extends == (asked.chunks if graphs else 0), asked
                results[graphs, chunk].append(llm.next_token_logits(question))
    for i, p in enumerate((prompt, question)):
        ref = model(torch.tensor([p], device="cuda:0"), logits_to_keep=1).logits[0, -1].float().cpu()
        bound = 0.1 * max(ref.abs().max().item(), 1.0)
        for chunk in (256, 384):
            graphed, eager = results[True, chunk][i], results[False, chunk][i]
            d_ref, d_eager = (graphed - ref).abs().max().item(), (graphed - eager).abs().max().item()
            print(f"extend graphs on {devices}, chunks of {chunk}, prompt {len(p)}: max |logit diff| against "
                  f"transformers {d_ref:.4f}, against the eager extend {d_eager:.4f}")
            assert d_ref <= bound and d_eager <= bound, (len(p), chunk, d_ref, d_eager)


def test_mixed_batch_in_cuda_graphs_matches_eager_and_transformers(hf_bf16_checkpoint):
    """--mixed-batch with CUDA graphs: a 3000-token prompt in chunks of 256 while 3 requests decode, each
    chunk and their decode step one graph replay (engine/runner/extend_graphs.py); every request's tokens and
    logprobs are the eager mixed batch's (bf16 noise) up to a near-tie, and transformers' greedy tokens."""
    from burstserve.engine import LLM, SamplingParams
    from burstserve.kernels.paged_attention import fa4_available
    if not fa4_available(torch.device("cuda:0")):
        pytest.skip("extend CUDA graphs need flash-attn-4")
    path, model = hf_bf16_checkpoint
    prompts = [[random.randrange(2000) for _ in range(n)] for n in (100, 500, 1000, 3000)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=1)
    runs = {}
    for graphs in (True, False):
        with LLM(path, devices="cuda:0", dtype="bfloat16", max_num_batched_tokens=256, itl_target_ms=None,
                 mixed_batch=True, max_num_seqs=8, cuda_graphs=graphs, enable_prefix_caching=False) as llm:
            outs = llm.generate(prompts, params)
        stats = outs[-1].metrics.prefill_stats
        assert stats.strategy == "extend+decode" and stats.graphed_extends == (stats.chunks - 1 if graphs else 0)
        runs[graphs] = [o.outputs[0] for o in outs]
    for prompt, g, e in zip(prompts, runs[True], runs[False]):
        _, ref_tokens, margins, scales = _hf_greedy(model, prompt, 40, with_scales=True)
        same = next((i for i, (a, b) in enumerate(zip(g.token_ids, e.token_ids)) if a != b), len(g.token_ids))
        print(f"mixed batch, graphs vs eager, prompt {len(prompt)}: {same} of 40 tokens identical")
        for i in range(same):
            t = g.token_ids[i]
            assert abs(g.logprobs[i][t] - e.logprobs[i][t]) < 0.1, (len(prompt), i)
        for i, (a, b) in enumerate(zip(g.token_ids, ref_tokens)):
            if a != b:
                assert margins[i] < tie_tolerance(scales[i]), (len(prompt), i, margins[i], scales[i])
                break


def test_small_chunk_after_a_long_prefix_splits_the_prefix_and_matches_transformers(hf_bf16_checkpoint,
                                                                                     monkeypatch):
    """ModelRunner.extend on one GPU, in this process: a 100-token chunk after 4000 cached tokens with the
    prefix cut into runs (MIN_RUN_KEYS lowered from 32768 so that a short prompt takes the path) gives
    transformers' next-token logits (bf16 noise), and the split path was taken at every layer."""
    import burstserve.engine.runner.extend_attention as ea
    import burstserve.kernels.paged_attention as pa
    from burstserve.engine.model.config import EngineConfig, resolve_model
    from burstserve.engine.runner.model_runner import ModelRunner
    from burstserve.engine.core.calls import Extend, Prefill, SampleNext
    from burstserve.engine.core.sampling import RowSampling
    from burstserve.engine.worker import runner_alone
    if not pa.fa4_available(torch.device("cuda:0")):
        pytest.skip("the prefix runs need flash-attn-4")
    path, model = hf_bf16_checkpoint
    monkeypatch.setattr(pa, "MIN_RUN_KEYS", 1024)
    taken = []
    real = ea.split_prefix_attention
    monkeypatch.setattr(ea, "split_prefix_attention", lambda *a: taken.append(a[5].used.shape[0]) or real(*a))
    # a pool for this prompt only: the runner lives in this process, and a pool sized from free memory
    # (0.9 of the GPU) would leave the next test's engine no room until the collector found the runner
    # eager extends: with CUDA graphs a chunk this small replays engine/runner/extend_graphs.py's graph instead
    engine = EngineConfig(model=path, devices=["cuda:0"], dtype="bfloat16", kv_cache_tokens=8192, cuda_graphs=False)
    cfg, max_model_len = resolve_model(engine)
    runner = ModelRunner(engine, cfg, 0, torch.device("cuda:0"), None, max_model_len)
    taken.clear()                           # the runner's start warms the split path's kernels (warm_extend_kernels)
    ids = [random.randrange(2000) for _ in range(4100)]
    kv = runner_alone(runner)                 # places each call (where its tokens go) and runs it on the runner
    kv.call(Prefill(0, torch.tensor(ids[:4000])))
    logits = kv.call(Extend(0, torch.tensor(ids[4000:]), 4000, sample_next=SampleNext(RowSampling(), logits=True))).logits
    assert taken == [3] * cfg.num_layers                       # min(132 // 8 CTAs, 4000 // 1024, 8)
    ref = model(torch.tensor([ids], device="cuda:0"), logits_to_keep=1).logits[0, -1].float().cpu()
    diff = (logits - ref).abs().max().item()
    print(f"prefix runs on one GPU: max |logit diff| {diff:.4f}")
    assert diff <= 0.1 * max(ref.abs().max().item(), 1.0)


def test_decode_in_cuda_graphs_matches_eager_decode_and_transformers(hf_bf16_checkpoint):
    """A batch of five prompts (1 to 3000 tokens, page boundaries crossed in prompts and while decoding)
    decoded from CUDA graphs gives the eager decode's tokens and logprobs (bf16 noise) and transformers'
    greedy tokens up to near-ties. Both runs prefill each prompt in one call (chunk sizes follow timings, and
    a chunk would ride with decode steps in the graphs' run only); every failed check is reported with its
    step, the largest logprob gaps and the margins, not only the first."""
    from burstserve.engine import LLM, SamplingParams
    from burstserve.kernels.paged_attention import fa4_available
    if not fa4_available(torch.device("cuda:0")):
        pytest.skip("decode CUDA graphs need flash-attn-4 (not installed here)")
    path, model = hf_bf16_checkpoint
    prompts = [[random.randrange(2000) for _ in range(n)] for n in (1, 127, 128, 1000, 3000)]
    params = SamplingParams(temperature=0, max_tokens=140, ignore_eos=True, logprobs=1)
    options = dict(devices="cuda:0", dtype="bfloat16", max_num_seqs=8, enable_chunked_prefill=False)
    with LLM(path, **options) as llm:
        assert llm.worker_facts[0].cuda_graphs
        graphed = [o.outputs[0] for o in llm.generate(prompts, params)]
    with LLM(path, cuda_graphs=False, **options) as llm:
        assert not llm.worker_facts[0].cuda_graphs
        eager = [o.outputs[0] for o in llm.generate(prompts, params)]
    failures = []
    for prompt, g, e in zip(prompts, graphed, eager):
        _, ref_tokens, margins, scales = _hf_greedy(model, prompt, 140, with_scales=True)
        same = next((i for i, (a, b) in enumerate(zip(g.token_ids, e.token_ids)) if a != b), len(g.token_ids))
        gaps = sorted(((abs(g.logprobs[i][g.token_ids[i]] - e.logprobs[i][g.token_ids[i]]), i) for i in range(same)),
                      reverse=True)[:3]
        print(f"graphs vs eager, prompt {len(prompt)}: {same} of 140 tokens identical; largest logprob gaps "
              + ", ".join(f"{gap:.3f} at step {i}" for gap, i in gaps))
        if gaps and gaps[0][0] >= 0.1:            # bf16: the graphs split keys otherwise
            failures.append(f"prompt {len(prompt)}: graphs' logprob {gaps[0][0]:.3f} from eager's at step {gaps[0][1]}")
        for name, run in (("graphs", g), ("eager", e)):
            i = next((i for i, (a, b) in enumerate(zip(run.token_ids, ref_tokens)) if a != b), None)
            if i is not None and margins[i] >= tie_tolerance(scales[i]):
                failures.append(f"prompt {len(prompt)}: {name} left transformers' greedy tokens at step {i} "
                                f"({run.token_ids[i]} for {ref_tokens[i]}), transformers' margin {margins[i]:.4f} >= "
                                f"{tie_tolerance(scales[i]):.4f} (top logit {scales[i]:.3f})")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("devices", ["cuda:0", "cuda:0,1"])
def test_async_scheduling_in_cuda_graphs_gives_the_tokens_of_sync_scheduling(hf_bf16_checkpoint, devices):
    """Decode steps launched before the last one's tokens are read (their input tokens gathered on the GPU
    from the step before, pinned host copies, no host synchronization; on 2 GPUs broadcast from worker 0)
    give exactly the tokens (and logprobs, copied to the host with them) of steps read back first: greedy
    and seeded top-p rows, the same batches replayed by the same graphs. Then transformers' greedy tokens
    up to near-ties."""
    from burstserve.engine import LLM, SamplingParams
    from burstserve.kernels.paged_attention import fa4_available
    if devices == "cuda:0,1" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if not fa4_available(torch.device("cuda:0")):
        pytest.skip("decode CUDA graphs need flash-attn-4 (not installed here)")
    path, model = hf_bf16_checkpoint
    prompts = [[random.randrange(2000) for _ in range(n)] for n in (1, 50, 127, 128, 1000, 3000)]
    params = [SamplingParams(temperature=0, max_tokens=140, ignore_eos=True, logprobs=[None, 2][i % 4 == 0])
              if i % 2 == 0 else
              SamplingParams(temperature=0.8, top_p=0.9, seed=random.randrange(1 << 20), max_tokens=140,
                             ignore_eos=True, logprobs=[None, 0][i % 4 == 1]) for i in range(len(prompts))]
    runs = {}
    for asynchronous in (True, False):
        # chunked prefill off: chunk sizes follow timings, and the two runs must prefill alike
        with LLM(path, devices=devices, dtype="bfloat16", max_num_seqs=8, async_scheduling=asynchronous,
                 enable_prefix_caching=False, enable_chunked_prefill=False) as llm:
            assert llm.worker_facts[0].cuda_graphs
            runs[asynchronous] = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
    assert runs[True] == runs[False]
    for prompt, p, (tokens, _) in zip(prompts, params, runs[True]):
        if p.greedy:
            _, ref_tokens, margins, scales = _hf_greedy(model, prompt, 140, with_scales=True)
            for i, (a, b) in enumerate(zip(tokens, ref_tokens)):
                if a != b:
                    assert margins[i] < tie_tolerance(scales[i]), (len(prompt), i, margins[i], scales[i])
                    break


@pytest.mark.parametrize("gpus", [2, 4])
def test_engine_bf16_on_several_gpus_matches_transformers(hf_bf16_checkpoint, gpus):
    """Default flags on 2 and on 4 GPUs (from three workers the ring's merges move: BurstAttention.forward)."""
    from burstserve.engine import LLM, SamplingParams
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    path, model = hf_bf16_checkpoint
    noise = 0.1    # bf16 logit noise between two correct implementations at this size
    lengths = [1, 3, 37, 1000, 8191]
    prompts = [[random.randrange(2000) for _ in range(n)] for n in lengths]
    devices = "cuda:" + ",".join(str(i) for i in range(gpus))
    with LLM(path, devices=devices, dtype="bfloat16") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            ref_logits, ref_tokens, margins, scales = _hf_greedy(model, prompt, 32, with_scales=True)
            logits = llm.next_token_logits(prompt)
            scale = ref_logits.abs().max().item()
            diff = (logits - ref_logits).abs().max().item()
            print(f"bf16 prompt {len(prompt)}: max |logit diff| {diff:.4f} (max |logit| {scale:.2f})")
            assert diff <= noise * max(scale, 1.0), len(prompt)
            tokens = out.outputs[0].token_ids
            for i, (a, b) in enumerate(zip(tokens, ref_tokens)):
                if a != b:   # allowed only where transformers' own top-2 margin is within bf16 noise
                    print(f"bf16 prompt {len(prompt)}: tokens diverge at step {i}, reference margin {margins[i]:.4f}")
                    assert margins[i] < tie_tolerance(scales[i]), (len(prompt), i, margins[i], scales[i])
                    break


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("strategy", ["burst-nolao", "ring-rsa", "ulysses", "cqs", "tp", "tp-v3", "auto", "burst-zero",
                                      "burst-zero-sliced"])
def test_every_strategy_on_two_gpus_matches_transformers(hf_bf16_checkpoint, strategy):
    """Also: the last prompt is sent twice, so its twin decodes from forked K/V. burst-zero-sliced: burst-zero
    with prompts up to 1000 tokens on the MLP's slices (every worker attends every head and keeps its own rows),
    the 4099 gathered."""
    from burstserve.engine import LLM, SamplingParams
    path, model = hf_bf16_checkpoint
    prompts = [[random.randrange(2000) for _ in range(n)] for n in (3, 1000, 4099)]
    prompts.append(prompts[-1])
    options = ({"sp_strategy": "burst-zero", "zero_sliced_max_tokens": 1000} if strategy == "burst-zero-sliced"
               else {"sp_strategy": "burst-zero", "zero_sliced_max_tokens": 0} if strategy == "burst-zero"
               else {"sp_strategy": strategy})     # burst-zero: every prompt gathered (unset: measured at start)
    # in one prefill each: with streams decoding, a GPU's chunking cuts even a short prompt to keep their gap, and a
    # prompt's strategy is its last chunk's
    with LLM(path, devices="cuda:0,1", dtype="bfloat16", auto_ulysses_max_tokens=1000, enable_chunked_prefill=False,
             **options) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        assert outs[-1].metrics.prefill_stats.shared_prefill
        if strategy == "burst-zero-sliced":
            ways = [(o.metrics.prefill_stats.strategy, o.metrics.prefill_stats.chunks) for o in outs[:3]]
            assert [w for w, _ in ways] == ["burst-zero-sliced"] * 2 + ["burst-zero"], ways
        for prompt, out in zip(prompts, outs):
            ref_logits, ref_tokens, margins, scales = _hf_greedy(model, prompt, 16, with_scales=True)
            diff = (llm.next_token_logits(prompt) - ref_logits).abs().max().item()
            print(f"{strategy} prompt {len(prompt)}: max |logit diff| {diff:.4f}")
            assert diff <= 0.1 * max(ref_logits.abs().max().item(), 1.0), (strategy, len(prompt))
            for i, (a, b) in enumerate(zip(out.outputs[0].token_ids, ref_tokens)):
                if a != b:
                    assert margins[i] < tie_tolerance(scales[i]), (strategy, len(prompt), i, margins[i], scales[i])
                    break


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_burst_zero_measures_which_prompts_run_on_the_slices(hf_bf16_checkpoint):
    """Unset, --zero-sliced-max-tokens is measured at start, the same on both workers, and a prompt under it
    runs on the slices (one over it gathered), both with transformers' greedy tokens up to bf16 near-ties."""
    from burstserve.engine import LLM, SamplingParams
    path, model = hf_bf16_checkpoint
    with LLM(path, devices="cuda:0,1", dtype="bfloat16", sp_strategy="burst-zero",
             enable_chunked_prefill=False) as llm:                 # each prompt in one prefill, its strategy seen
        limits = [info.zero_sliced_max_tokens for info in llm.worker_facts]
        print(f"burst-zero on 2 GPUs: prompts of up to {limits} tokens on the slices")
        assert limits[0] == limits[1] > 0
        lengths = (1, max(1, limits[0] // 2), min(limits[0] + 300, 12000))   # 1: worker 1 keeps no token;
                                                                              # the checkpoint holds 16384
        prompts = [[random.randrange(2000) for _ in range(n)] for n in lengths]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        ways = ["burst-zero-sliced" if n <= limits[0] else "burst-zero" for n in lengths]
        seen = [(o.metrics.prefill_stats.strategy, o.metrics.prefill_stats.chunks) for o in outs]
        assert [w for w, _ in seen] == ways, seen
        for prompt, out in zip(prompts, outs):
            _, ref_tokens, margins, scales = _hf_greedy(model, prompt, 8, with_scales=True)
            for i, (a, b) in enumerate(zip(out.outputs[0].token_ids, ref_tokens)):
                if a != b:
                    assert margins[i] < tie_tolerance(scales[i]), (len(prompt), i, margins[i], scales[i])
                    break



@pytest.mark.parametrize("devices", ["cuda:0", "cuda:0,1"])
def test_shutdown_after_cuda_graphs_on_one_gpu_and_two(hf_bf16_checkpoint, devices):
    """Workers whose CUDA graphs captured NCCL collectives (decode and extends, on 2 GPUs) leave on their own
    at shutdown: exit code 0 within the engine's 10 s grace, not terminated. The graphs are released before
    the process group is destroyed (with them alive, destroy_process_group waits on them for ever:
    pytorch/pytorch#115388)."""
    import time
    from burstserve.engine import LLM, SamplingParams
    workers = devices.count(",") + 1
    if torch.cuda.device_count() < workers:
        pytest.skip(f"needs {workers} GPUs")
    path, _ = hf_bf16_checkpoint
    llm = LLM(path, devices=devices, dtype="bfloat16")
    try:
        assert all(info.cuda_graphs for info in llm.worker_facts)
        prompt = [random.randrange(2000) for _ in range(600)]
        llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))            # decode graphs
        longer = prompt + [random.randrange(2000) for _ in range(40)]                     # an extend of the
        llm.generate([longer], SamplingParams(max_tokens=8, ignore_eos=True))            # cached prompt
    finally:
        start = time.perf_counter()
        llm.shutdown()
        took = time.perf_counter() - start
    print(f"{workers} GPU(s): shutdown in {took:.2f} s, exit codes {[p.exitcode for p in llm._procs]}")
    assert [p.exitcode for p in llm._procs] == [0] * workers and took < 10

@torch.no_grad()
def _fp32_next_token_logits(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """transformers in fp32 on cuda:0 (the checkpoint's fp32 weights, one whole forward pass without a cache):
    each prompt's next-token logits [V] on the CPU; the model is freed before returning."""
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")
    model = model.to("cuda:0").eval()
    logits = [model(torch.tensor([p], device="cuda:0"), use_cache=False).logits[0, -1].float().cpu()
              for p in prompts]
    del model
    torch.cuda.empty_cache()
    return logits


_BACKEND_STRATEGIES = ["burst", "burst-nolao", "ring-rsa", "ulysses", "cqs", "tp", "tp-v3", "burst-zero"]


@pytest.mark.parametrize("strategy,gpus", [("burst", 1)] + [(s, 2) for s in _BACKEND_STRATEGIES] + [("burst", 4)])
def test_each_strategy_with_flash_attn_4_matches_cudnn_and_fp32(hf_bf16_checkpoint, strategy, gpus):
    """Issue 18: a strategy's prefill on `gpus` GPUs with --attention-backend flash-attn and with cudnn (the
    same bf16 weights; only the attention kernel differs) gives next-token logits that agree with each other
    and with transformers in fp32, within bf16 noise. Prefix caching off: every call is a whole prefill
    through the strategy (checked by name). One GPU: burst, the check of this test itself; four: burst with
    three merges a worker, each queued after the next exchange (BurstAttention.forward)."""
    from burstserve.engine import LLM, SamplingParams
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    missing = [b for b in ("flash-attn", "cudnn") if b not in _gpu_backends()]
    if missing:
        pytest.skip(f"--attention-backend {' and '.join(missing)} cannot run here")
    path, _ = hf_bf16_checkpoint
    prompts = [[random.randrange(2000) for _ in range(n)] for n in (5, 1000, 4099)]   # 4099: uneven shards
    refs = _fp32_next_token_logits(path, prompts)
    devices = "cuda:" + ",".join(str(i) for i in range(gpus))
    options = {"zero_sliced_max_tokens": 0} if strategy == "burst-zero" else {}   # every prompt gathered
    logits = {}
    for backend in ("flash-attn", "cudnn"):
        with LLM(path, devices=devices, dtype="bfloat16", sp_strategy=strategy, attention_backend=backend,
                 enable_prefix_caching=False, cuda_graphs=False, **options) as llm:
            assert llm.kernel == {"flash-attn": "flash_attn_4"}.get(backend, backend)
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
            assert [o.metrics.prefill_stats.strategy for o in outs] == [strategy] * len(prompts)
            logits[backend] = [llm.next_token_logits(p) for p in prompts]
    for prompt, ref, fa4, cudnn in zip(prompts, refs, logits["flash-attn"], logits["cudnn"]):
        bound = 0.1 * max(ref.abs().max().item(), 1.0)     # bf16 noise at this size, as the tests above
        diffs = [(fa4 - ref).abs().max().item(), (cudnn - ref).abs().max().item(), (fa4 - cudnn).abs().max().item()]
        print(f"{strategy} on {gpus} GPU(s), prompt {len(prompt)}: max |logit diff| flash-attn-4 vs fp32 "
              f"{diffs[0]:.4f}, cuDNN vs fp32 {diffs[1]:.4f}, flash-attn-4 vs cuDNN {diffs[2]:.4f}")
        assert max(diffs) <= bound, (strategy, len(prompt), diffs, bound)


def test_fp8_engine_on_one_gpu_matches_its_model_and_decodes_in_graphs(hf_bf16_checkpoint):
    """--quantization fp8 on one GPU. The engine's first-token logits equal the same checkpoint's
    LlamaModel with FP8 linears run whole on one device with the engine's attention kernel (the
    engine's plumbing adds nothing: a bf16-sized difference in an activation can flip its FP8
    rounding, which this random model amplifies as much as FP8 itself, so the kernels must be the
    same); that model is further from transformers than bf16 is (quantized) but within 0.5 (relative,
    centered: this random 4-layer model amplifies FP8's 2^-4 rounding 10-16x more than bf16's 2^-8);
    decode from CUDA graphs gives the eager FP8 decode's tokens and logprobs up to near-ties."""
    from burstserve.engine import LLM, SamplingParams
    from burstserve.engine.model.config import load_model_config
    from burstserve.engine.model.model import LlamaModel, hf_weight_shapes
    from burstserve.engine.model.weights import load_weights
    from burstserve.kernels.attention import select_backend
    path, model = hf_bf16_checkpoint
    cfg = load_model_config(path)
    dev = torch.device("cuda:0")
    backend = select_backend(dev, torch.bfloat16, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, "auto")

    def whole(quantization, prompt):
        m = LlamaModel(cfg, load_weights(path, list(hf_weight_shapes(cfg)), dev, torch.bfloat16), dev,
                       quantization=quantization)
        ids = torch.tensor(prompt, device=dev)
        attend = lambda layer, q, k, v: backend(q, k, v, True, cfg.head_dim ** -0.5)[0]    # noqa: E731
        with torch.inference_mode():
            return m.logits(m.forward(ids, torch.arange(len(prompt), device=dev), attend)[-1:])[0].cpu()

    def rel(a, ref):
        return ((a - ref).norm() / (ref - ref.mean()).norm()).item()

    prompts = [[random.randrange(2000) for _ in range(n)] for n in (3, 1000, 8191)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1)
    runs = {}
    for graphs in (True, False):
        with LLM(path, devices="cuda:0", dtype="bfloat16", quantization="fp8", cuda_graphs=graphs,
                 enable_prefix_caching=False,      # next_token_logits: a whole prefill, not a cache hit
                 enable_chunked_prefill=False) as llm:   # chunk sizes follow timings: both runs prefill alike
            runs[graphs] = [o.outputs[0] for o in llm.generate(prompts, params)]
            if graphs:
                engine_logits = [llm.next_token_logits(p) for p in prompts]
    for prompt, got in zip(prompts, engine_logits):
        ref = _hf_greedy(model, prompt, 1)[0]
        fp8_model, bf16_model = whole("fp8", prompt), whole("none", prompt)
        print(f"fp8 prompt {len(prompt)}: engine vs FP8 model {rel(got, fp8_model):.4f}; against transformers: "
              f"FP8 model {rel(fp8_model, ref):.4f}, bf16 model {rel(bf16_model, ref):.4f}")
        assert rel(got, fp8_model) < 0.05, (len(prompt), backend.name)
        assert rel(bf16_model, ref) < rel(fp8_model, ref) < 0.5, len(prompt)
    for prompt, g, e in zip(prompts, runs[True], runs[False]):
        same = next((i for i, (a, b) in enumerate(zip(g.token_ids, e.token_ids)) if a != b), len(g.token_ids))
        print(f"fp8 graphs vs eager, prompt {len(prompt)}: {same} of 32 tokens identical")
        for i in range(min(same + 1, 32)):
            t = g.token_ids[i]
            assert abs(g.logprobs[i][t] - e.logprobs[i].get(t, g.logprobs[i][t])) < 0.1, (len(prompt), i)


@pytest.mark.parametrize("k", [1024, 4096, 14336])
def test_fp8_row_quantization_kernel_matches_the_torch_ops(k):
    """burstserve.kernels.fused.quantize_fp8_rows (one Triton kernel) against kernels/fp8.py's torch ops: the same
    scales (fp32 vs the bf16-rounded factor's inverse: within 0.4%), the same values within one FP8 step,
    and an FP8 GEMM through either within bf16 noise."""
    from burstserve.kernels import fp8, fused
    x = (torch.randn(777, k, device="cuda:0") * torch.rand(777, 1, device="cuda:0") * 8).to(torch.bfloat16)
    x[3] = 0
    got = fused.quantize_fp8_rows(x)
    assert got is not None, "no Triton kernel on this GPU"
    q, s = got
    fused_ok, fused._triton.enabled = fused._triton.enabled, False
    try:
        q_ref, s_ref = fp8.quantize_rows(x)
    finally:
        fused._triton.enabled = fused_ok
    assert q.dtype == fp8.FP8 and s.shape == (777, 1) and torch.allclose(s, s_ref, rtol=5e-3)
    back, back_ref = q.float() * s, q_ref.float() * s_ref
    row_max = x.float().abs().amax(dim=1, keepdim=True)
    assert ((back - back_ref).abs() <= x.float().abs() / 8 + row_max / 2**8).all()
    assert (back[3] == 0).all() and not torch.isnan(back).any()


def test_fp8_rows_made_by_the_norm_and_silu_kernels_are_the_two_steps_bits(hf_bf16_checkpoint):
    """kernels/fp8.py's rms_norm_rows and silu_and_mul_rows (the norm or silu and the per-token FP8
    quantization in one Triton kernel) give the bits of the bf16 kernel then quantize_fp8_rows, at
    llama3-8b's widths; so a whole FP8 model's logits are the same bits with them (fp8_rows, the
    default) as with the two steps (the path tp-v3's gathered rows take)."""
    from burstserve.engine.model.config import load_model_config
    from burstserve.engine.model.model import LlamaModel, hf_weight_shapes
    from burstserve.engine.model.weights import load_weights
    from burstserve.kernels import fp8, fused
    from burstserve.kernels.attention import select_backend
    dev = torch.device("cuda:0")

    def bits(rows):
        return rows.values.view(torch.uint8), rows.scale

    for n in (4096, 8192):
        x, r = (torch.randn(2, 333, n, device=dev) * 3).to(torch.bfloat16)
        w = torch.randn(n, device=dev).to(torch.bfloat16)
        rows, res = fp8.rms_norm_rows(x, w, 1e-5, r)
        out, res_ref = fused.rms_norm(x, w, 1e-5, r)
        want = fused.quantize_fp8_rows(out)
        assert want is not None and torch.equal(res, res_ref)
        assert all(torch.equal(a, b) for a, b in zip(bits(rows), (want[0].view(torch.uint8), want[1])))
    gate_up = (torch.randn(333, 2 * 14336, device=dev) * 2).to(torch.bfloat16)
    rows, want = fp8.silu_and_mul_rows(gate_up), fused.quantize_fp8_rows(fused.silu_and_mul(gate_up))
    assert all(torch.equal(a, b) for a, b in zip(bits(rows), (want[0].view(torch.uint8), want[1])))

    path, _ = hf_bf16_checkpoint
    cfg = load_model_config(path)
    backend = select_backend(dev, torch.bfloat16, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, "auto")
    ids = torch.randint(0, 2000, (777,), device=dev)
    attend = lambda layer, q, k, v: backend(q, k, v, True, cfg.head_dim ** -0.5)[0]    # noqa: E731
    m = LlamaModel(cfg, load_weights(path, list(hf_weight_shapes(cfg)), dev, torch.bfloat16), dev,
                   quantization="fp8")
    assert m.fp8_rows
    logits = {}
    for rows in (True, False):
        m.fp8_rows = rows
        with torch.inference_mode():
            logits[rows] = m.logits(m.forward(ids, torch.arange(777, device=dev), attend))
    assert torch.equal(logits[True], logits[False])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_hosts_one_gpu_each_match_transformers(hf_bf16_checkpoint):
    """Issue 15 on one 2-GPU machine: the head (this process's LLM, cuda:0) and a second "host"
    (`burstserve worker --node-rank 1 --devices cuda:1`) form one engine over NCCL; its logits and greedy
    tokens agree with transformers (bf16 noise), prefill ring and decode across the two process trees."""
    import os
    import subprocess
    import sys
    from burstserve.clients.server_process import ROOT, free_port
    from burstserve.engine import LLM, SamplingParams
    path, model = hf_bf16_checkpoint
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    joiner = subprocess.Popen([sys.executable, "-m", "burstserve.server.cli", "worker", "--model", path, "--devices", "cuda:1",
                               "--dtype", "bfloat16", "--nnodes", "2", "--node-rank", "1", "--master-port", str(port),
                               "--join-timeout", "120"], cwd=ROOT, env=env, start_new_session=True)
    try:
        prompts = [[random.randrange(2000) for _ in range(n)] for n in (3, 1000, 4099)]
        with LLM(path, devices="cuda:0", dtype="bfloat16", nnodes=2, master_port=port, join_timeout=120) as llm:
            assert llm.engine.devices == ["cuda:0", "cuda:1"]
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
            for prompt, out in zip(prompts, outs):
                ref_logits, ref_tokens, margins, scales = _hf_greedy(model, prompt, 16, with_scales=True)
                diff = (llm.next_token_logits(prompt) - ref_logits).abs().max().item()
                print(f"two hosts, prompt {len(prompt)}: max |logit diff| {diff:.4f}")
                assert diff <= 0.1 * max(ref_logits.abs().max().item(), 1.0), len(prompt)
                for i, (a, b) in enumerate(zip(out.outputs[0].token_ids, ref_tokens)):
                    if a != b:
                        assert margins[i] < tie_tolerance(scales[i]), (len(prompt), i, margins[i], scales[i])
                        break
        assert joiner.wait(timeout=60) == 0          # the engine's shutdown ends the joined host cleanly
    finally:
        if joiner.poll() is None:
            joiner.kill()


@pytest.mark.parametrize("gpus", [1, 2])
def test_torch_cp_peer_matches_transformers(hf_bf16_checkpoint, gpus):
    """The benchmark's torch-cp peer (clients/torch_cp.py: transformers' model under PyTorch's
    context_parallel on `gpus` GPUs, one process each) gives the prompt's next-token logits of one plain
    forward pass (bf16 noise): the peer the tables compare against computes the same thing."""
    from burstserve.clients.torch_cp import next_token_logits_torch_cp
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    path, model = hf_bf16_checkpoint
    prompt = [random.randrange(2000) for _ in range(4096)]       # PyTorch's balancer: a multiple of 2 x GPUs
    logits = next_token_logits_torch_cp(path, "cuda", prompt, "bfloat16", context_parallel_size=gpus)
    ref = model(torch.tensor([prompt], device="cuda:0"), logits_to_keep=1).logits[0, -1].float().cpu()
    diff = (logits - ref).abs().max().item()
    print(f"torch-cp on {gpus} GPU(s): max |logit diff| {diff:.4f}")
    assert diff <= 0.1 * max(ref.abs().max().item(), 1.0)


@pytest.mark.parametrize("strategy", ["one GPU", "burst", "ulysses", "tp"])
def test_fp8_kv_cache_matches_transformers_with_kv_rounded(hf_bf16_checkpoint, strategy):
    """--kv-cache-dtype fp8 (decode in CUDA graphs on the FP8 decode kernel; chunks and prefix hits over
    gathered FP8 pages): logits and greedy tokens against transformers (bf16) with K/V rounded alike (bf16
    noise); a prompt in chunks of 1024 and one extending it (a prefix hit) too; graphs against eager decode;
    the pool holds about twice bf16's tokens. On one GPU, and on 2 with burst (the K/V ring sends FP8
    bytes), ulysses and tp."""
    from hf_reference import kv_rounded
    from burstserve.engine import LLM, SamplingParams
    from burstserve.kernels import kv_quant
    path, model = hf_bf16_checkpoint
    # Rounded alike is not bit-alike: the two sides' K and V differ by bf16 noise before rounding, and where
    # an element sits near the middle of two e4m3 values (3 mantissa bits) that noise rounds it a whole FP8
    # step apart (1/8 relative). So the logits differ by more than bf16 noise (0.1 of max |logit| elsewhere
    # in this file): 0.15 here, and greedy tokens may part where the reference's margin is within twice the
    # first token's measured difference. A wrong page or scale differs by the logits' own size.
    noise = 0.15
    prompts = [[random.randrange(2000) for _ in range(n)] for n in (3, 1000, 5000)]
    prompts.append(prompts[2] + [random.randrange(2000) for _ in range(300)])          # a prefix hit
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    capacity = {}
    gpus = dict(devices="cuda:0") if strategy == "one GPU" else dict(devices="cuda:0,1", sp_strategy=strategy)
    if strategy != "one GPU" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for kv, graphs in (("fp8", True), ("fp8", False), ("auto", True)):
        with LLM(path, **gpus, dtype="bfloat16", kv_cache_dtype=kv, cuda_graphs=graphs,
                 max_num_batched_tokens=1024, gpu_memory_utilization=0.5) as llm:
            capacity[kv] = llm.worker_facts[0].kv_capacity_tokens
            if kv == "auto":
                continue
            assert llm.worker_facts[0].kv_cache_dtype == "fp8"
            assert llm.worker_facts[0].cuda_graphs == graphs
            outs = [llm.generate(p, greedy)[0] for p in prompts]
            assert (outs[3].metrics.prefill_stats.cached_tokens or 0) >= 5000
            for prompt, out in zip(prompts, outs):
                with kv_rounded(model, kv_quant.round_kv):
                    ref_logits, ref_tokens, margins, scales = _hf_greedy(model, prompt, 16, with_scales=True)
                diff = (llm.next_token_logits(prompt) - ref_logits).abs().max().item()
                print(f"fp8 KV, graphs {graphs}, prompt {len(prompt)}: max |logit diff| {diff:.4f}")
                assert diff <= noise * max(ref_logits.abs().max().item(), 1.0), len(prompt)
                for i, (a, b) in enumerate(zip(out.outputs[0].token_ids, ref_tokens)):
                    if a != b:
                        print(f"fp8 KV, prompt {len(prompt)}: tokens diverge at step {i}, reference margin {margins[i]:.4f}")
                        assert margins[i] < max(tie_tolerance(scales[i]), 2 * diff), (len(prompt), i, margins[i], diff)
                        break
    print(f"KV pool at gpu_memory_utilization 0.5: fp8 {capacity['fp8']} tokens, bf16 {capacity['auto']}")
    assert capacity["fp8"] >= 1.9 * capacity["auto"], capacity


def _stream_tokens(llm, request_id: str) -> list[int]:
    tokens = []
    for out in llm.results(request_id):
        tokens.append(out.token_id)
        if out.finish_reason is not None:
            return tokens


@pytest.mark.parametrize("kv,devices", [("auto", "cuda:0"), ("fp8", "cuda:0"), ("auto", "cuda:0,1")])
def test_host_tier_restores_match_transformers_beside_decoding_streams(hf_bf16_checkpoint, kv, devices):
    """--kv-offload-gb on one GPU (pinned host memory, copies on side streams): four 3000-token documents in a
    pool of two; a question about the first comes back from the host tier while four streams decode (the
    restore runs beside their steps). Its first-token logprobs equal those of the same question answered
    from the GPU pool (a pool large enough for all: the same K/V bytes, bf16 noise), and its greedy tokens
    and the streams' match transformers (bf16 noise; FP8 pages: K/V rounded alike). Greedy tokens are not
    compared across the two runs: the streams batch with the question differently, and bf16 GEMMs of other
    batch sizes round differently. On 2 GPUs each worker restores its own half."""
    if devices == "cuda:0,1" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    from hf_reference import kv_rounded
    from burstserve.engine import LLM, SamplingParams
    from burstserve.kernels import kv_quant
    path, model = hf_bf16_checkpoint
    docs = [[random.randrange(2000) for _ in range(3000)] for _ in range(4)]
    question = docs[0] + [random.randrange(2000) for _ in range(200)]
    streams = [[random.randrange(2000) for _ in range(500)] for _ in range(4)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    outs = {}
    for tier, pool in ((1.0, 8192), (0, None)):
        with LLM(path, devices=devices, dtype="bfloat16", kv_cache_dtype=kv, kv_offload_gb=tier,
                 kv_cache_tokens=pool and pool // (devices.count(",") + 1), max_num_batched_tokens=2048) as llm:
            for doc in docs:
                llm.generate(doc, one)
            ids = [llm.submit(s, long) for s in streams]
            time.sleep(0.2)
            got = llm.generate(question, greedy)[0]
            outs[tier] = got, [_stream_tokens(llm, i) for i in ids]
            stats = got.metrics.prefill_stats
            assert stats.cached_tokens == len(docs[0]), stats
            if tier:
                print(f"kv {kv}: host tier hit {stats.host_cached_tokens}, restore {stats.restore_seconds}")
                assert stats.host_cached_tokens == len(docs[0]), stats
                assert llm.stats.kv_offload_stored_bytes > 0
    (with_tier, tier_streams), (pool_hit, _) = outs[1.0], outs[0]
    a, b = with_tier.outputs[0].logprobs[0], pool_hit.outputs[0].logprobs[0]
    assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 0.05 for t in a), (a, b)
    context = kv_rounded(model, kv_quant.round_kv) if kv == "fp8" else contextlib.nullcontext()
    with context:
        for prompt, tokens in [(question, with_tier.outputs[0].token_ids)] + list(zip(streams, tier_streams)):
            _, ref_tokens, margins, scales = _hf_greedy(model, prompt, len(tokens), with_scales=True)
            for i, (x, y) in enumerate(zip(tokens, ref_tokens)):
                if x != y:
                    assert margins[i] < tie_tolerance(scales[i]), (len(prompt), i, margins[i], scales[i])
                    break


@pytest.fixture(scope="module")
def hf_moe_checkpoint(tmp_path_factory):
    """A Qwen3-MoE of 16 experts (top 4, renormalized; layer 2 dense) saved by transformers in fp32, and
    transformers' models of it on the GPU with its eager experts (the references), by dtype."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    path = str(tmp_path_factory.mktemp("qwen3-moe"))
    cfg = Qwen3MoeConfig(vocab_size=2000, hidden_size=1024, intermediate_size=2048, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=128, max_position_embeddings=16384,
                         rope_theta=1000000.0, initializer_range=0.05, num_experts=16, num_experts_per_tok=4,
                         moe_intermediate_size=256, norm_topk_prob=True, mlp_only_layers=[2])
    torch.manual_seed(random.randrange(1 << 30))
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)                       # a router that prefers some experts
    model.save_pretrained(path)
    models = {dtype: Qwen3MoeForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa",
                                                         experts_implementation="eager").to("cuda:0").eval()
              for dtype in (torch.float32, torch.bfloat16)}
    return path, models


def test_a_mixture_of_experts_on_one_gpu_in_fp32_matches_transformers(hf_moe_checkpoint):
    """The engine in fp32 on a GPU (the few-row kernels inside the decode steps' CUDA graphs; the prefill's experts on
    their routed path) against transformers in fp32: next-token logits within fp32 noise, and the same 16 greedy
    tokens unless transformers' own top two are within that noise. fp32 keeps the routing exact, so a difference
    here is an error, not a near-tie of the router (the bf16 test below cannot tell those apart). Attention runs
    in whichever backend passes fp32's probe (kernels/attention.select_backend)."""
    from burstserve.engine import LLM, SamplingParams
    path, models = hf_moe_checkpoint
    prompts = [[random.randrange(2000) for _ in range(n)] for n in (3, 1000, 5000)]
    with LLM(path, devices="cuda:0", dtype="float32") as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        for prompt, out in zip(prompts, outs):
            ref_logits, ref_tokens, margins, scales = _hf_greedy(models[torch.float32], prompt, 16, with_scales=True)
            diff = (llm.next_token_logits(prompt) - ref_logits).abs().max().item()
            print(f"mixture of experts, fp32, prompt {len(prompt)}: max |logit diff| {diff:.2e}")
            assert diff <= 1e-3 * max(ref_logits.abs().max().item(), 1.0), len(prompt)
            for i, (a, b) in enumerate(zip(out.outputs[0].token_ids, ref_tokens)):
                if a != b:
                    assert margins[i] < 1e-3 * max(abs(scales[i]), 1.0), (len(prompt), i, margins[i], scales[i])
                    break


def test_a_mixture_of_experts_on_one_gpu_in_bf16_is_as_near_fp32_as_transformers(hf_moe_checkpoint):
    """engine/model/moe.py's bf16 paths (the grouped GEMMs of the prefill, the few-row kernels in the decode steps'
    CUDA graphs) against transformers in fp32, with transformers' own bf16 run as the yardstick of bf16 noise: the
    engine's next-token logits no farther from fp32 than three times transformers' bf16 (or 2% of the logits' scale;
    the figures of a run: docs/results/2026-12-07-1xGPU-moe-engine). Greedy tokens are not compared: in bf16 a
    router near-tie sends a row to another expert in either implementation; the fp32 test above holds them."""
    from burstserve.engine import LLM
    path, models = hf_moe_checkpoint
    prompts = [[random.randrange(2000) for _ in range(n)] for n in (3, 1000, 5000)]
    with LLM(path, devices="cuda:0", dtype="bfloat16") as llm:
        for prompt in prompts:
            ref = _hf_greedy(models[torch.float32], prompt, 1)[0]
            hf_noise = (_hf_greedy(models[torch.bfloat16], prompt, 1)[0] - ref).abs().max().item()
            diff = (llm.next_token_logits(prompt) - ref).abs().max().item()
            print(f"mixture of experts, bf16, prompt {len(prompt)}: max |logit diff| from fp32 {diff:.4f}, "
                  f"transformers' bf16 {hf_noise:.4f}")
            assert diff <= max(3 * hf_noise, 0.02 * ref.abs().max().item()), len(prompt)
