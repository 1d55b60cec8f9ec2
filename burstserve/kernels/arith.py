"""Integer arithmetic shared by the kernels' launch shapes and the engine's page counts."""


def ceil_div(a: int, b: int) -> int:
    """The smallest integer >= a / b, for b > 0 (pages for a count of tokens, blocks for a count of rows)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1): a Triton block covering n lanes (tl.arange needs a power of 2)."""
    return 1 << max(n - 1, 0).bit_length()
