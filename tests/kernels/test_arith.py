"""kernels/arith.py: ceil_div against exact rational arithmetic on fresh random integers."""
import math
import random
from fractions import Fraction

from burstserve.engine.cache.ledger import pages_for
from burstserve.kernels.arith import ceil_div


def test_ceil_div_is_the_ceiling_of_the_quotient():
    rng = random.Random()
    for _ in range(1000):
        a, b = rng.randrange(-10**9, 10**9), rng.randrange(1, 10**6)
        assert ceil_div(a, b) == math.ceil(Fraction(a, b)), (a, b)
    for b in (1, 16, 128):
        assert [pages_for(n, b) for n in (0, 1, b, b + 1)] == [0, 1, 1, 2]
