"""The KV cache: a pool of pages on every worker, and the ledger of who holds which tokens."""
