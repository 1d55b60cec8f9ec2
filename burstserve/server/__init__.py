"""burstserve's HTTP front end: OpenAI-compatible API, SSE streaming, Prometheus metrics, CLI."""
