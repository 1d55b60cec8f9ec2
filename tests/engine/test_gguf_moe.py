"""GGUF mixtures of experts (engine/model/gguf.py): a small random Qwen3-MoE and Qwen2-MoE saved by transformers, written
again by the `gguf` package's GGUFWriter as llama.cpp's converter writes them (its tensor names, the experts stacked
[E, Im, hidden], F32, the metadata, a byte-level BPE tokenizer of the model's 320 tokens), and served from the file:
the conversion holds the twin's tensors bit for bit, and the engine's next-token logits and greedy tokens are
transformers' on the safetensors twin, on fresh random prompts, at 1 and 2 workers.

Every layer of these twins is sparse: llama.cpp's qwen3moe and qwen2moe name no dense MLP, so mlp_only_layers and
decoder_sparse_step > 1 (test_moe.py's twins) cannot be written. Mixtral cannot be read: llama.cpp writes it as
architecture "llama", which transformers 5.25 reads as a dense LlamaForCausalLM, skipping the experts (refused)."""
import dataclasses
import itertools
import os
import random
import signal

import httpx
import pytest
import torch

import hf_reference
from burstserve.clients.server_process import RemoteServer
from burstserve.engine import LLM, SamplingParams
from burstserve.engine.core.errors import ModelLoadError
from burstserve.engine.model.config import load_model_config
from burstserve.engine.model.gguf import converted_checkpoint
from hf_reference import hf_next_logits_and_greedy, save_tokenizer

KINDS = {"qwen3-moe": "qwen3moe", "qwen2-moe": "qwen2moe"}      # test kind -> llama.cpp's architecture
NUM_TOKENS = 8


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """engine/model/gguf.py's cache in a folder of this module's own."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BURSTSERVE_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield os.environ["BURSTSERVE_CACHE"]


def all_sparse_checkpoint(kind: str, path: str, seed: int) -> torch.nn.Module:
    """save_checkpoint's model of that kind with every layer sparse (what a GGUF file of it can hold)."""
    make_config = hf_reference.make_config

    def all_sparse(k):
        cfg = make_config(k)
        cfg.mlp_only_layers, cfg.decoder_sparse_step = [], 1
        return cfg
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hf_reference, "make_config", all_sparse)
        return hf_reference.save_checkpoint(kind, path, seed)


def byte_level_vocab(vocab_size: int) -> tuple[list[str], list[str]]:
    """save_tokenizer's vocabulary as GGUF spells it: (tokens by id, merges "a b")."""
    from tokenizers import pre_tokenizers
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<s>", "</s>"]
    merges = [f"{a} {b}" for a, b in itertools.islice(itertools.product("etaoinshrd", repeat=2),
                                                       vocab_size - len(tokens))]
    return tokens + [m.replace(" ", "") for m in merges], merges


def write_gguf(path: str, arch: str, config, tensors: dict[str, torch.Tensor]) -> None:
    """A transformers checkpoint's tensors (its per-expert names) and config as llama.cpp's converter writes them."""
    import gguf
    layers = config.num_hidden_layers
    names = gguf.get_tensor_name_map(next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch), layers)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_name(f"random {arch}")
    writer.add_block_count(layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_expert_count(config.num_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    tokens, merges = byte_level_vocab(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in ("<s>", "</s>") else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<s>"))
    writer.add_eos_token_id(tokens.index("</s>"))
    tensors = dict(tensors)
    for layer, part in itertools.product(range(layers), ("gate_proj", "up_proj", "down_proj")):
        p = f"model.layers.{layer}.mlp.experts."                 # [E, Im, hidden] (down [E, hidden, Im])
        tensors[f"{p}{part}.weight"] = torch.stack([tensors.pop(f"{p}{j}.{part}.weight")
                                                    for j in range(config.num_experts)])
    for name, tensor in sorted(tensors.items()):
        base, suffix = name.rsplit(".", 1)
        gguf_name = names.get_name(base)
        assert gguf_name is not None, name
        array = tensor.float().numpy()
        if gguf_name.endswith("ffn_gate_inp_shexp"):
            array = array[0]                                     # [1, hidden] stored as [hidden]
        writer.add_tensor(f"{gguf_name}.{suffix}", array)        # q and k as they are: no llama permutation
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module", params=list(KINDS))
def twins(request, cache, tmp_path_factory):
    """(kind, the safetensors folder, transformers' model of it, the GGUF file of the same weights)."""
    from safetensors.torch import load_file
    kind = request.param
    folder = str(tmp_path_factory.mktemp(kind))
    model = all_sparse_checkpoint(kind, folder, seed=random.randrange(1 << 30))
    path = os.path.join(str(tmp_path_factory.mktemp(f"{kind}-gguf")), f"{kind}.gguf")
    write_gguf(path, KINDS[kind], model.config, load_file(os.path.join(folder, "model.safetensors")))
    return kind, folder, model, path


def test_the_conversion_is_the_twin(twins, tmp_path):
    """The converted folder: the twin's tensors bit for bit under the twin's names, the twin's shapes and experts
    (rms_norm_eps as GGUF's float32 holds it), and the tokenizer save_tokenizer builds of the same vocabulary."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer
    kind, folder, model, path = twins
    converted = converted_checkpoint(path, "float32")
    want = load_file(os.path.join(folder, "model.safetensors"))
    got = load_file(os.path.join(converted, "model.safetensors"))
    assert sorted(got) == sorted(want), (kind, set(got) ^ set(want))
    for name in want:
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), (kind, name)
    cfg, ref = load_model_config(converted), load_model_config(folder)
    assert cfg.rms_norm_eps == pytest.approx(ref.rms_norm_eps, rel=1e-7)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (256, [257])       # the file's tokenizer ids; the twin has none
    assert dataclasses.replace(cfg, rms_norm_eps=ref.rms_norm_eps, bos_token_id=None, eos_token_ids=[]) == ref, kind
    assert cfg.num_experts and cfg.sparse_layers == tuple(range(cfg.num_layers)), cfg
    save_tokenizer(str(tmp_path))
    text = f"the red door is near the theatre, {random.randrange(10 ** 6)} steps in\n"
    assert AutoTokenizer.from_pretrained(converted)(text)["input_ids"] == \
        AutoTokenizer.from_pretrained(str(tmp_path))(text)["input_ids"]


@pytest.mark.parametrize("workers", [1, 2])
def test_the_engine_on_the_gguf_file_matches_transformers_on_the_twin(twins, workers):
    """The next token's logits within 1e-4 and the greedy continuation, prompts of 1, 2W-1, 37 and 200 random
    tokens, through the engine serving the GGUF file."""
    kind, folder, model, path = twins
    vocab = model.config.vocab_size
    prompts = [[random.randrange(vocab) for _ in range(n)] for n in sorted({1, 2 * workers - 1, 37, 200})]
    with LLM(path, devices="cpu", context_parallel_size=workers, dtype="float32") as llm:
        assert llm.engine.model == converted_checkpoint(path, "float32") and llm.model_config.num_experts
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True))
        for prompt, out in zip(prompts, outputs):
            want_logits, want_tokens = hf_next_logits_and_greedy(model, prompt, NUM_TOKENS)
            diff = (llm.next_token_logits(prompt) - want_logits).abs().max().item()
            assert diff <= 1e-4, f"{kind} on {workers}: {len(prompt)} tokens, logits differ by {diff}"
            assert out.outputs[0].token_ids == want_tokens, (kind, workers, len(prompt))


def test_a_mixtral_gguf_file_is_refused_by_name(cache, tmp_path):
    """llama.cpp writes Mixtral as architecture "llama" with stacked experts: transformers builds a dense Llama
    and finds no MLP in the file, which is refused at start naming the file and the first missing tensor."""
    import gguf
    path = str(tmp_path / "mixtral.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 256), (writer.add_embedding_length, 8),
                       (writer.add_feed_forward_length, 16), (writer.add_head_count, 2), (writer.add_head_count_kv, 2),
                       (writer.add_expert_count, 4), (writer.add_expert_used_count, 2)):
        add(value)
    tokens, merges = byte_level_vocab(260)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    shapes = {"token_embd": (260, 8), "output_norm": (8,), "output": (260, 8), "blk.0.attn_norm": (8,),
              "blk.0.attn_q": (8, 8), "blk.0.attn_k": (8, 8), "blk.0.attn_v": (8, 8), "blk.0.attn_output": (8, 8),
              "blk.0.ffn_norm": (8,), "blk.0.ffn_gate_inp": (4, 8), "blk.0.ffn_gate_exps": (4, 16, 8),
              "blk.0.ffn_up_exps": (4, 16, 8), "blk.0.ffn_down_exps": (4, 8, 16)}
    for name, shape in shapes.items():
        writer.add_tensor(f"{name}.weight", torch.randn(shape).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"mixtral.gguf: transformers reads this GGUF file \('llama'\) as "
                                             r"LlamaForCausalLM but finds no tensor for model.layers.0.mlp"):
        LLM(path, devices="cpu")


def test_a_server_that_converted_the_file_stops_cleanly_on_ctrl_c(twins, tmp_path, monkeypatch):
    """A first start converts the file in the server's own process (transformers' GGUF reading, which loads Triton's
    bindings); Ctrl-C to the process group then ends it with exit 0, and its log holds no traceback and not the
    bindings' report of objects alive at interpreter exit (nanobind's "leaked ..." lines)."""
    kind, folder, model, path = twins
    monkeypatch.setenv("BURSTSERVE_CACHE", str(tmp_path / "cache"))        # a fresh cache: this start converts
    log_path = tmp_path / "server.log"
    with open(log_path, "wb") as out:
        srv = RemoteServer(["--model", path, "--devices", "cpu", "--dtype", "float32"], log_level="info",
                           output=out, timeout=180)
    try:
        answer = httpx.post(srv.url("/v1/completions"), json={"model": path, "prompt": [5, 6, 7], "max_tokens": 2},
                            timeout=60)
        assert answer.status_code == 200, answer.text
        os.killpg(srv.proc.pid, signal.SIGINT)
        code = srv.proc.wait(timeout=60)
    finally:
        srv.stop()
    log = log_path.read_text(errors="replace")
    assert code == 0 and "SIGINT: shutting down" in log, log[-3000:]
    assert "leaked" not in log and "Traceback" not in log, log[-3000:]
