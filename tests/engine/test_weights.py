"""Loading a worker's part of the weights (issue 14 item 1): under tp each worker reads only its slice of
each sharded tensor from the safetensors files (and draws a preset's slice of the same random tensor),
holds exactly its share of the sharded weights (that tp over them gives transformers' logits:
test_strategies.py); weights that cannot fit are refused before anything is allocated, with the numbers."""
import random

import pytest
import torch

from dist_harness import run_on_ranks
from burstserve.engine import LLM, EngineDeadError
from burstserve.engine.core.calls import Prefill
from burstserve.engine.model.config import EngineConfig, resolve_model
from burstserve.engine.model.model import hf_weight_shapes
from burstserve.engine.model.weights import load_weights, random_weights, take_slice, weight_bytes
from burstserve.engine.parallel import get_strategy
from burstserve.engine.parallel.tensor_parallel import tp_slices
from burstserve.engine.worker import runner_alone
from hf_reference import save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen2"))      # q/k/v biases: sliced with their weights
    return path, save_checkpoint("qwen2", path, seed=random.randrange(1 << 30))


def test_sliced_reads_equal_slices_of_the_whole_tensors(checkpoint):
    path, model = checkpoint
    cfg, _ = resolve_model(EngineConfig(model=path, devices=["cpu"]))
    names = list(hf_weight_shapes(cfg))
    whole = load_weights(path, names, torch.device("cpu"), torch.float32)
    for rank in range(2):
        slices = tp_slices(cfg, rank, 2)
        part = load_weights(path, names, torch.device("cpu"), torch.float32, slices)
        assert {n for n in slices if n.endswith("bias")}, "the qwen2 shape has biases to slice"
        for name in names:
            want = take_slice(whole[name], slices[name]) if name in slices else whole[name]
            assert torch.equal(part[name], want), name


def test_random_slices_are_slices_of_the_same_random_weights():
    cfg, _ = resolve_model(EngineConfig(model="tiny", devices=["cpu"]))
    shapes = hf_weight_shapes(cfg)
    whole = random_weights(shapes, torch.device("cpu"), torch.float32, seed=7)
    slices = tp_slices(cfg, 1, 2)
    part = random_weights(shapes, torch.device("cpu"), torch.float32, seed=7, slices=slices)
    for name in shapes:
        want = take_slice(whole[name], slices[name]) if name in slices else whole[name]
        assert torch.equal(part[name], want), name


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _worker_weight_bytes(rank, world_size, path, strategy):
    """-> (bytes of the weights this worker holds, and under burst-zero for each layer of one prefill: (bytes
    of gathers in flight, bytes of the whole layer in use), and the gathers left over after it)."""
    from burstserve.engine.runner.model_runner import ModelRunner
    engine = EngineConfig(model=path, devices=["cpu"] * world_size, sp_strategy=strategy, dtype="float32")
    cfg, max_model_len = resolve_model(engine)
    runner = ModelRunner(engine, cfg, rank, torch.device("cpu"), None, max_model_len)
    m = runner.model
    held = _tensor_bytes([m.embed, m.norm] + ([] if m.lm_head is m.embed else [m.lm_head]))
    held += sum(_tensor_bytes(vars(layer).values()) for layer in m.layers)
    gather, samples = runner.whole_layers, []
    if gather is not None:
        whole_layer = gather.layer

        def layer(i):
            weights = whole_layer(i)
            samples.append((gather.bytes_in_flight(), _tensor_bytes(vars(weights).values())))
            return weights
        gather.layer = layer
        runner_alone(runner).call(Prefill(0, torch.randint(0, 300, (50,))))
    return held, samples, len(gather._arriving) if gather else 0


@pytest.mark.parametrize("strategy", ["tp", "burst-zero"])
def test_each_worker_holds_only_its_share(checkpoint, strategy):
    """Bytes of every tensor each of 2 workers holds, as weight_bytes computes: under tp the replicated ones
    (embedding, norms, LM head) plus half of each sharded one; under burst-zero half of the MLP, the
    embedding and the LM head (cut by vocabulary), the attention's weights and the norms whole; together
    less than twice the model. Under burst-zero a prefill gathers each layer's MLP whole, one layer ahead:
    as each layer starts, its whole weights in use and the next layer's MLP in flight (inside layer(i),
    while layer i's gathered slices are put in order, three layers' worth: LayerGather.reserve_bytes), none
    left after the prefill."""
    path, _ = checkpoint
    cfg, _ = resolve_model(EngineConfig(model=path, devices=["cpu"]))
    shapes = hf_weight_shapes(cfg)
    results = run_on_ranks(_worker_weight_bytes, 2, path, strategy)
    whole = weight_bytes(shapes, 4)
    sharded = {n: s for n, s in shapes.items() if n in tp_slices(cfg, 0, 2)}
    layer_bytes = weight_bytes({n: s for n, s in shapes.items() if n.startswith("model.layers.0.")}, 4)
    norms = weight_bytes({n: s for n, s in shapes.items() if n.endswith("norm.weight")}, 4)
    attention = weight_bytes({n: s for n, s in shapes.items()
                              if ".self_attn." in n and not n.endswith("norm.weight")}, 4)
    gathered = weight_bytes({n: s for n, s in shapes.items() if n.startswith("model.layers.0.mlp.")}, 4)
    for rank, (nbytes, samples, left) in enumerate(results):
        assert nbytes == weight_bytes(shapes, 4, get_strategy(strategy, 2).weight_slices(cfg, rank))
        if strategy == "tp":                      # embedding and LM head whole on every worker
            assert nbytes == whole - weight_bytes(sharded, 4) // 2
        else:                                     # burst-zero: the norms and the attention whole, half the rest
            assert nbytes == (whole - norms - attention) // 2 + norms + attention
        if strategy == "burst-zero":
            assert len(samples) == cfg.num_layers and left == 0
            assert all(in_use == layer_bytes for _, in_use in samples), samples
            assert [flight for flight, _ in samples] == [gathered] * (cfg.num_layers - 1) + [0]
    assert sum(nbytes for nbytes, _, _ in results) < 2 * whole


def test_weights_that_do_not_fit_are_refused_with_the_numbers():
    """A 70B preset on this machine's CPU: refused before any weight is drawn."""
    with pytest.raises(EngineDeadError, match=r"would hold [\d.]+ GiB of weights .* more than .* use --sp-strategy tp"):
        LLM("llama3-70b", devices="cpu")


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "all_to_all_single", "reduce_scatter")


def _collectives_of_a_decode_step(rank, world_size, path, strategy):
    """-> {collective: calls} of one decode step of one sequence, after its prompt's prefill, on this worker."""
    import torch.distributed as dist
    from burstserve.engine.core.calls import Decode
    from burstserve.engine.runner.model_runner import ModelRunner
    engine = EngineConfig(model=path, devices=["cpu"] * world_size, sp_strategy=strategy, dtype="float32")
    cfg, max_model_len = resolve_model(engine)
    runner = ModelRunner(engine, cfg, rank, torch.device("cpu"), None, max_model_len)
    kv = runner_alone(runner)
    kv.call(Prefill(0, torch.randint(0, 300, (50,), generator=torch.Generator().manual_seed(1))))
    calls = dict.fromkeys(COLLECTIVES, 0)
    for name in COLLECTIVES:
        real = getattr(dist, name)

        def counted(*args, _name=name, _real=real, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)
        setattr(dist, name, counted)
    kv.call(Decode([0], [7], [50]))
    return {name: n for name, n in calls.items() if n}, cfg.num_layers


def test_a_burst_zero_decode_step_takes_two_collectives_a_layer(checkpoint):
    """burst-zero decodes with the attention's weights whole and the MLP sliced: per layer the partials'
    all-gather and the all-reduce after down (as tp's two), and per step the embedding's all-reduce and the
    logits' all-gather over the vocabulary slices; burst (whole weights) one all-gather a layer."""
    path, _ = checkpoint
    one_each = {"all_gather": 1, "all_reduce": 1}
    for strategy, per_layer, per_step in (("burst-zero", one_each, one_each), ("burst", {"all_gather": 1}, {})):
        for calls, layers in run_on_ranks(_collectives_of_a_decode_step, 2, path, strategy):
            want = {name: n * layers + per_step.get(name, 0) for name, n in per_layer.items()}
            assert calls == want, (strategy, calls)
