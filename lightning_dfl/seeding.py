"""Independent, order-free random streams derived from one seed."""

from __future__ import annotations

import zlib

import numpy as np


def derive_seed(seed: int, stream: str, *keys: int) -> int:
    """A 63-bit seed for ``stream`` (e.g. ``"data"``) at ``keys`` (e.g. round, client).

    Each (seed, stream, keys) gets its own stream, so a client's randomness in a round does not
    depend on which other tasks ran before it.
    """
    entropy = [int(seed) & 0xFFFFFFFF, zlib.crc32(stream.encode()), *(int(k) & 0xFFFFFFFF for k in keys)]
    state = np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0]
    return int(state >> np.uint64(1))
