"""A worker's KV pages: the page pool, the host tier, their sizing."""
