"""burstserve: a long-context LLM inference server (BurstAttention prefill over a sharded KV cache).

One import package so that nothing this distribution installs can shadow, or be shadowed by, another
distribution's top-level module (Hugging Face's `kernels`, which transformers depends on, is one):
`burstserve.engine` (model, strategies, KV cache, scheduler, workers, the offline `LLM`),
`burstserve.kernels` (attention kernels returning (out, lse), the fp32 merge, FP8),
`burstserve.server` (FastAPI app, protocol, metrics, CLI) and `burstserve.clients` (the benchmark)."""
