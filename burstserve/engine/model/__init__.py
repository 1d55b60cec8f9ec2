"""The model: its configuration, layers, experts, RoPE, weights and checkpoint formats (GGUF)."""
