"""The KV cache's ledger, on worker 0's scheduler's side: who holds which tokens on which pages, the prefix cache, what a
call takes (the pages themselves: engine/pages/)."""
