"""Mixtures of experts (engine/model/moe.py): Qwen3-MoE, Mixtral and Qwen2-MoE against transformers on the same saved
random checkpoints, in fp32 on CPU workers. The sparse block alone on fresh rows (its routing ties too); the engine
at 1-3 workers under every strategy (those that keep the experts whole on each worker, and tp, tp-v3 and burst-zero,
which cut every expert by width); chunked prefill and a prefix hit; widths the workers do not divide refused by name;
the presets' shapes."""
import math
import random
from dataclasses import replace

import pytest
import torch

from burstserve.engine import LLM, EngineDeadError, SamplingParams
from burstserve.engine.model.config import load_model_config, preset_config
from burstserve.engine.model.model import hf_weight_shapes
from burstserve.engine.model.moe import (every_expert, expert_slices, expert_weight_shapes, experts_mlp, grouped_experts,
                                  route, routed_experts, take_expert_weights)
from burstserve.engine.model.weights import load_weights
from burstserve.engine.parallel.tensor_parallel import gate_up_row_index, sliced_mlp_config, tp_check
from burstserve.engine.parallel.zero import LayerGather, zero_check
from hf_reference import hf_next_logits_and_greedy, save_checkpoint

KINDS = ["qwen3-moe", "mixtral", "qwen2-moe"]
NUM_TOKENS = 12


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    model = save_checkpoint(request.param, path, seed=random.randrange(1 << 30))
    return request.param, path, model


def _sparse_layer(path: str):
    cfg = load_model_config(path)
    assert cfg.num_experts and cfg.sparse_layers, cfg
    layer = random.choice(cfg.sparse_layers)
    names = [n for n in hf_weight_shapes(cfg) if n.startswith(f"model.layers.{layer}.") and ("mlp" in n or "moe" in n)]
    weights = load_weights(path, names, torch.device("cpu"), torch.float32)
    return cfg, layer, take_expert_weights(cfg, weights, layer)


def test_the_sparse_layers_are_the_models(checkpoint):
    """Which layers route to experts, as transformers builds them (Qwen3-MoE's mlp_only_layers, Qwen2-MoE's
    decoder_sparse_step)."""
    kind, path, model = checkpoint
    cfg = load_model_config(path)
    sparse = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert cfg.sparse_layers == sparse and 0 < len(sparse) <= cfg.num_layers, (kind, cfg.sparse_layers, sparse)


def test_the_experts_equal_transformers_sparse_block_on_fresh_rows(checkpoint):
    """experts_mlp against the layer's own transformers module on random rows; the graph-safe every_expert sum
    against the routed one."""
    kind, path, model = checkpoint
    cfg, layer, experts = _sparse_layer(path)
    x = torch.randn(random.randrange(1, 200), cfg.hidden_size)
    with torch.no_grad():
        want = model.model.layers[layer].mlp(x[None])[0]
        got = experts_mlp(x, experts)
        weights, chosen = route(x, experts)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(every_expert(x, experts, weights, chosen),
                                   routed_experts(x, experts, weights, chosen), atol=1e-5, rtol=1e-5)


def test_the_grouped_gemms_equal_the_routed_experts(checkpoint):
    """grouped_experts (the GPU's path: torch's grouped GEMM, which the CPU runs too) in bfloat16 against the routed
    experts in fp32 on the same rows, a few rows as in a decode step (most experts an empty group) and many."""
    kind, path, model = checkpoint
    cfg, layer, experts = _sparse_layer(path)
    for n in (1, 3, random.randrange(100, 400)):
        x = torch.randn(n, cfg.hidden_size)
        weights, chosen = route(x, experts)
        want = routed_experts(x, experts, weights, chosen)
        bf16 = {name: getattr(experts, name).bfloat16() for name in ("gate_up", "down")}
        half = type(experts)(**{**vars(experts), **bf16})
        got = grouped_experts(x.bfloat16(), half, weights if experts.weights_fp32 else weights.bfloat16(), chosen)
        assert got.dtype == torch.bfloat16 and got.shape == want.shape
        torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=0.05)


def test_routing_ties_break_as_transformers_breaks_them(checkpoint):
    """A router of equal rows ties every expert for every token: the chosen experts are transformers' own."""
    kind, path, model = checkpoint
    cfg, layer, experts = _sparse_layer(path)
    experts.router = torch.randn(1, cfg.hidden_size).expand(cfg.num_experts, -1).contiguous()
    x = torch.randn(64, cfg.hidden_size)
    gate = model.model.layers[layer].mlp.gate
    saved = gate.weight.detach().clone()
    try:
        with torch.no_grad():
            gate.weight.copy_(experts.router)
            _, want_weights, want_chosen = gate(x)
            weights, chosen = route(x, experts)
    finally:
        with torch.no_grad():
            gate.weight.copy_(saved)                  # the module's model is the other tests' reference
    assert torch.equal(chosen, want_chosen)
    torch.testing.assert_close(weights.float(), want_weights.float())


# every kind at 1, 2 and 3 workers, every strategy at least once: those that keep the experts whole on each worker,
# and those that cut every expert by width (tp, tp-v3, burst-zero; burst-zero's short prompts on the slices too)
SLICED_UP_TO_40 = {"zero_sliced_max_tokens": 40}
RUNS = {
    "qwen3-moe": [("burst", 1, {}), ("burst", 3, {}), ("ulysses", 2, {}), ("cqs", 3, {}), ("tp", 2, {}),
                  ("burst-zero", 2, SLICED_UP_TO_40)],
    "mixtral": [("single", 1, {}), ("burst", 2, {}), ("ring-rsa", 3, {}), ("auto", 2, {}), ("tp-v3", 2, {}),
                ("burst-zero", 2, {})],
    "qwen2-moe": [("tp", 1, {}), ("burst", 2, {}), ("burst-nolao", 3, {}), ("tp", 2, {}), ("tp-v3", 2, {}),
                  ("burst-zero", 2, SLICED_UP_TO_40)],
}


@pytest.mark.parametrize("run", range(6))
def test_the_engine_matches_transformers(checkpoint, run):
    """The next token's logits after each prompt and the greedy continuation, prompts of 1, 2W-1, 37 and 300 tokens
    (empty workers, uneven shards)."""
    kind, path, model = checkpoint
    strategy, workers, options = RUNS[kind][run]
    prompts = [[random.randrange(model.config.vocab_size) for _ in range(n)] for n in sorted({1, 2 * workers - 1, 37, 300})]
    with LLM(path, devices="cpu", context_parallel_size=workers, dtype="float32", sp_strategy=strategy,
             enable_chunked_prefill=False, **options) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
        for prompt, out in zip(prompts, outputs):
            want_logits, want_tokens = hf_next_logits_and_greedy(model, prompt, NUM_TOKENS)
            diff = (llm.next_token_logits(prompt) - want_logits).abs().max().item()
            assert diff <= 1e-4, f"{kind}, {strategy} on {workers}: {len(prompt)} tokens, logits differ by {diff}"
            assert out.outputs[0].token_ids == want_tokens, (kind, strategy, workers, len(prompt))


@pytest.mark.parametrize("strategy", ["burst", "burst-zero"])
def test_chunks_and_a_prefix_hit_match_transformers(checkpoint, strategy):
    """A 700-token prompt in chunks of 128 on two workers, then a prompt sharing its first 512 tokens (taken from the
    prefix cache): each one's greedy tokens and next-token logits are transformers'. burst-zero: the chunks on each
    layer's experts gathered whole, decode on their slices."""
    kind, path, model = checkpoint
    vocab = model.config.vocab_size
    first = [random.randrange(vocab) for _ in range(700)]
    second = first[:512] + [random.randrange(vocab) for _ in range(90)]
    with LLM(path, devices="cpu", context_parallel_size=2, dtype="float32", max_num_batched_tokens=128,
             sp_strategy=strategy) as llm:
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outs = [llm.generate([p], params)[0] for p in (first, second)]
        stats = [o.metrics.prefill_stats for o in outs]
        assert stats[0].chunks > 1 and stats[1].cached_tokens >= 256, stats
        for prompt, out in zip((first, second), outs):
            want_logits, want_tokens = hf_next_logits_and_greedy(model, prompt, NUM_TOKENS)
            assert out.outputs[0].token_ids == want_tokens, (kind, strategy, len(prompt))
            diff = (llm.next_token_logits(prompt) - want_logits).abs().max().item()
            assert diff <= 1e-4, f"{kind}, {strategy}, {len(prompt)} tokens: logits differ by {diff}"


def test_expert_widths_the_workers_do_not_divide_are_refused_by_name(checkpoint):
    """tp refuses, and burst-zero falls back to whole weights naming, an expert or shared-expert width that the
    workers do not divide."""
    kind, path, model = checkpoint
    cfg = load_model_config(path)
    assert tp_check(cfg, 2) is None and zero_check(cfg, 2) is None
    odd = replace(cfg, moe_intermediate_size=cfg.moe_intermediate_size + 1)
    assert f"experts' width {odd.moe_intermediate_size}; 2 workers do not divide it" in tp_check(odd, 2)
    assert zero_check(odd, 2).startswith("burst-zero splits each of the")
    if cfg.shared_expert_intermediate_size:
        odd = replace(cfg, shared_expert_intermediate_size=cfg.shared_expert_intermediate_size + 1)
        assert "the shared expert's width" in tp_check(odd, 2)


def test_burst_zero_gathers_every_expert_whole_from_the_slices(checkpoint):
    """LayerGather's assembly of the workers' width slices (as the loader cuts them: expert_slices) gives back each
    sparse layer's whole experts, the shared expert's too."""
    kind, path, model = checkpoint
    cfg, layer, whole = _sparse_layer(path)
    full = load_weights(path, list(expert_weight_shapes(cfg, layer)), torch.device("cpu"), torch.float32)
    workers = 2
    local = sliced_mlp_config(cfg, workers)
    slices = [take_expert_weights(local, _cut(dict(full), expert_slices(cfg, layer, r, workers)), layer)
              for r in range(workers)]
    gather = LayerGather.__new__(LayerGather)               # its assembly alone: no process group
    gather.shared_gate_up_index = gate_up_row_index(cfg.shared_expert_intermediate_size, workers)
    parts = [torch.stack([getattr(s, n) for s in slices]) for n in ("gate_up", "down", "shared_gate_up", "shared_down")
             if getattr(whole, n) is not None]
    got = gather._whole_experts(slices[0], parts)
    for name in ("router", "gate_up", "down", "shared_gate_up", "shared_down", "shared_gate"):
        want = getattr(whole, name)
        assert (want is None and getattr(got, name) is None) or torch.equal(getattr(got, name), want), name


def _cut(weights: dict[str, torch.Tensor], slices: dict[str, tuple[int, int, int]]) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors cut as the loader cuts them for one worker."""
    for name, (dim, start, stop) in slices.items():
        weights[name] = weights[name].narrow(dim, start, stop - start)
    return weights


def test_the_presets_have_the_released_models_sizes():
    """Parameters of the presets' shapes against the released models' counts: Qwen3-30B-A3B 30.5B (3.3B active),
    Mixtral 8x7B 46.7B (12.9B active), Qwen3-235B-A22B 235.1B."""
    for name, total, active in (("qwen3-30b-a3b", 30.53e9, 3.35e9), ("mixtral-8x7b", 46.70e9, 12.88e9),
                                ("qwen3-235b-a22b", 235.09e9, 22.19e9)):
        cfg = preset_config(name)
        shapes = hf_weight_shapes(cfg)
        count = sum(math.prod(s) for s in shapes.values())
        per_expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        unused = len(cfg.sparse_layers) * (cfg.num_experts - cfg.num_experts_per_tok) * per_expert
        assert count == pytest.approx(total, rel=0.005), name
        assert count - unused == pytest.approx(active, rel=0.005), name


def test_a_preset_larger_than_the_host_is_refused_with_its_figures():
    with pytest.raises(EngineDeadError, match="GiB of weights.*tp or burst-zero over more devices.*experts included"):
        LLM("qwen3-235b-a22b", devices="cpu")
