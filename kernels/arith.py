"""Integer arithmetic shared by the kernels' launch shapes and the engine's page counts."""


def ceil_div(a: int, b: int) -> int:
    """The smallest integer >= a / b, for b > 0 (pages for a count of tokens, blocks for a count of rows)."""
    return -(-a // b)
