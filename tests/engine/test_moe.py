"""Mixtures of experts (engine/moe.py): Qwen3-MoE, Mixtral and Qwen2-MoE against transformers on the same saved
random checkpoints, in fp32 on CPU workers. The sparse block alone on fresh rows (its routing ties too); the engine
at 1-3 workers under every strategy that keeps the experts whole on each worker; chunked prefill and a prefix hit;
the strategies that slice the MLP refused by name; the presets' shapes."""
import math
import random

import pytest
import torch

from burstserve.engine import LLM, EngineDeadError, InvalidRequestError, SamplingParams
from burstserve.engine.config import load_model_config, preset_config
from burstserve.engine.model import hf_weight_shapes
from burstserve.engine.moe import (every_expert, experts_mlp, grouped_experts, route, routed_experts,
                                  take_expert_weights)
from burstserve.engine.weights import load_weights
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


# every kind at 1, 2 and 3 workers, and every strategy that keeps the experts whole on each worker at least once
RUNS = {
    "qwen3-moe": [("burst", 1), ("burst", 3), ("ulysses", 2), ("cqs", 3)],
    "mixtral": [("single", 1), ("burst", 2), ("ring-rsa", 3), ("auto", 2)],
    "qwen2-moe": [("tp", 1), ("burst", 2), ("burst-nolao", 3), ("burst-zero", 2)],
}


@pytest.mark.parametrize("run", range(4))
def test_the_engine_matches_transformers(checkpoint, run):
    """The next token's logits after each prompt and the greedy continuation, prompts of 1, 2W-1, 37 and 300 tokens
    (empty workers, uneven shards). burst-zero keeps the experts whole (its slices are the dense MLP's)."""
    kind, path, model = checkpoint
    strategy, workers = RUNS[kind][run]
    prompts = [[random.randrange(model.config.vocab_size) for _ in range(n)] for n in sorted({1, 2 * workers - 1, 37, 300})]
    with LLM(path, devices="cpu", context_parallel_size=workers, dtype="float32", sp_strategy=strategy,
             enable_chunked_prefill=False) as llm:
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
        for prompt, out in zip(prompts, outputs):
            want_logits, want_tokens = hf_next_logits_and_greedy(model, prompt, NUM_TOKENS)
            diff = (llm.next_token_logits(prompt) - want_logits).abs().max().item()
            assert diff <= 1e-4, f"{kind}, {strategy} on {workers}: {len(prompt)} tokens, logits differ by {diff}"
            assert out.outputs[0].token_ids == want_tokens, (kind, strategy, workers, len(prompt))


def test_chunks_and_a_prefix_hit_match_transformers(checkpoint):
    """A 700-token prompt in chunks of 128 on two workers, then a prompt sharing its first 512 tokens (taken from the
    prefix cache): each one's greedy tokens and next-token logits are transformers'."""
    kind, path, model = checkpoint
    vocab = model.config.vocab_size
    first = [random.randrange(vocab) for _ in range(700)]
    second = first[:512] + [random.randrange(vocab) for _ in range(90)]
    with LLM(path, devices="cpu", context_parallel_size=2, dtype="float32", max_num_batched_tokens=128) as llm:
        params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
        outs = [llm.generate([p], params)[0] for p in (first, second)]
        stats = [o.metrics.prefill_stats for o in outs]
        assert stats[0].chunks > 1 and stats[1].cached_tokens >= 256, stats
        for prompt, out in zip((first, second), outs):
            want_logits, want_tokens = hf_next_logits_and_greedy(model, prompt, NUM_TOKENS)
            assert out.outputs[0].token_ids == want_tokens, (kind, len(prompt))
            diff = (llm.next_token_logits(prompt) - want_logits).abs().max().item()
            assert diff <= 1e-4, f"{kind}, {len(prompt)} tokens: logits differ by {diff}"


@pytest.mark.parametrize("strategy", ["tp", "tp-v3"])
def test_the_strategies_that_slice_the_mlp_are_refused_by_name(checkpoint, strategy):
    kind, path, model = checkpoint
    with pytest.raises(InvalidRequestError, match="mixture of experts.*--sp-strategy burst") as refused:
        LLM(path, devices="cpu", context_parallel_size=2, dtype="float32", sp_strategy=strategy)
    assert refused.value.param == "sp_strategy"


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
    with pytest.raises(EngineDeadError, match="GiB of weights.*experts are held whole on every worker"):
        LLM("qwen3-235b-a22b", devices="cpu")
