"""burstserve: a long-context LLM inference server (BurstAttention prefill over a sharded KV cache).

One import package so that nothing this distribution installs can shadow, or be shadowed by, another
distribution's top-level module (Hugging Face's `kernels`, which transformers depends on, is one):
`burstserve.engine` (model, strategies, KV cache, scheduler, workers, the offline `LLM`),
`burstserve.kernels` (attention kernels returning (out, lse), the fp32 merge, FP8),
`burstserve.server` (FastAPI app, protocol, metrics, CLI) and `burstserve.clients` (the benchmark)."""

# The offline API at the top, as vLLM has it (`from burstserve import LLM, SamplingParams`), imported on first use:
# `import burstserve.server.cli` does not pay for the engine's imports until it needs them.
_ENGINE_NAMES = ("LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "BurstServeError", "ClusterError",
                 "DeviceSpecError", "EngineDeadError", "InvalidRequestError", "ModelLoadError", "PromptTooLongError")
__all__ = list(_ENGINE_NAMES)


def __getattr__(name: str):
    if name in _ENGINE_NAMES:
        from burstserve import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'burstserve' has no attribute {name!r}")
