"""Worker 0's scheduler: the policy's plan, the step carried out and its results applied, the sequences and
their tokens."""
