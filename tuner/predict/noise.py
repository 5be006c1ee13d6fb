"""The simulated engine's step noise: `random.Random(seed).lognormvariate(mu, sigma)`, value for value, drawn in
blocks with numpy (a tail SLO's simulated capacity search draws millions; the standard library's Kinderman-Monahan
loop took a third of a prediction's time).

Exact, not merely alike: numpy's MT19937 is given the standard generator's state (the same Mersenne Twister words),
each double is built from two 32-bit words as `random.random()` builds it (genrand_res53), and the
Kinderman-Monahan acceptance test and `mu + z * sigma` are the standard library's own operations, element by element.
Only the logarithm of the test and the final exponential are libm functions numpy may round differently: the
exponential is taken with `math.exp`, and an acceptance whose two sides lie within 1e-9 of each other is re-decided
with `math.log`. The first values are checked against the standard library's at construction (a Python whose
`normalvariate` changed fails there, not silently).
"""

from __future__ import annotations

import math
import random
from typing import Any

NV_MAGICCONST = 4 * math.exp(-0.5) / math.sqrt(2.0)  # as the random module defines it
BLOCK = 4096  # attempts (pairs of uniforms) drawn at a time; ~73% become values
CHECK = 16  # values compared with the standard library's at construction


class LognormalStream:
    """The values `random.Random(seed).lognormvariate(mu, sigma)` returns, one after another: `next()` one,
    `take(k)` the next k as an array."""

    def __init__(self, seed: Any, mu: float, sigma: float) -> None:
        import numpy as np

        self.mu, self.sigma = float(mu), float(sigma)
        state = random.Random(seed).getstate()[1]
        self.bits = np.random.MT19937()
        self.bits.state = {"bit_generator": "MT19937",
                           "state": {"key": np.array(state[:624], dtype=np.uint32), "pos": state[624]}}
        self.buf = np.empty(0)
        self.values: list[float] = []
        self.i = 0
        reference = random.Random(seed)
        want = [reference.lognormvariate(mu, sigma) for _ in range(CHECK)]
        got = self.take(CHECK).tolist()
        if got != want:
            raise RuntimeError("the block noise generator does not reproduce random.lognormvariate on this Python: "
                               f"{got[:2]} vs {want[:2]}")
        self.i = 0  # the values checked are the stream's first: read again

    def refill(self) -> None:
        """Append the next block's values to what is left unread."""
        import numpy as np

        raw = self.bits.random_raw(4 * BLOCK)
        u = ((raw[0::2] >> 5).astype(np.float64) * 67108864.0 + (raw[1::2] >> 6)) * (1.0 / 9007199254740992.0)
        u1 = u[0::2]
        u2 = 1.0 - u[1::2]
        z = NV_MAGICCONST * (u1 - 0.5) / u2
        zz = z * z / 4.0
        neg_log = -np.log(u2)
        accept = zz <= neg_log
        close = np.flatnonzero(np.abs(zz - neg_log) <= 1e-9 * np.maximum(np.abs(neg_log), 1e-300))
        for k in close.tolist():  # libm's logarithm decides where numpy's rounding could
            accept[k] = zz[k] <= -math.log(u2[k])
        x = (self.mu + z[accept] * self.sigma).tolist()
        fresh = np.fromiter(map(math.exp, x), dtype=np.float64, count=len(x))
        self.buf = np.concatenate((self.buf[self.i:], fresh))
        self.values = self.buf.tolist()
        self.i = 0

    def next(self) -> float:
        if self.i >= len(self.values):
            self.refill()
        v = self.values[self.i]
        self.i += 1
        return v

    def take(self, k: int) -> Any:
        """The next `k` values (a numpy array)."""
        while self.i + k > len(self.values):
            self.refill()
        out = self.buf[self.i:self.i + k]
        self.i += k
        return out

    def peek(self, k: int) -> list[float]:
        """The next `k` values without consuming them (a list)."""
        while self.i + k > len(self.values):
            self.refill()
        return self.values[self.i:self.i + k]

    def skip(self, k: int) -> None:
        """Consume `k` values already peeked."""
        self.i += k
