"""Benchmark clients: prefill latency (time to first token) and baselines."""
