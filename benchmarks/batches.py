"""RL-shaped sequence lengths shared by the benchmarks: log-normal, the way response lengths of an
RL micro-batch spread (tens to thousands of tokens)."""

from __future__ import annotations

import math
import random


def lognormal_lengths(n: int, median: float, seed: int, sigma: float = 1.0, max_len: int | None = None) -> list:
    """``n`` lengths ``round(median * exp(N(0, sigma)))``, at least 1 and at most ``max_len``; the
    same list for the same arguments (``random.Random(seed)``)."""
    rng = random.Random(seed)
    out = [max(1, int(round(median * math.exp(rng.gauss(0.0, sigma))))) for _ in range(n)]
    return out if max_len is None else [min(max_len, x) for x in out]
