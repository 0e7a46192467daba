"""Independent, order-free random streams derived from one seed."""

from __future__ import annotations

import zlib

import numpy as np

#: the largest seed a run, its data, its model or a callback takes: NumPy's and scikit-learn's seeds and Lightning's
#: ``seed_everything`` are unsigned 32-bit integers, and :func:`derive_seed` reads a seed's low 32 bits only
MAX_SEED = 2**32 - 1


def derive_seed(seed: int, stream: str, *keys: int) -> int:
    """A 63-bit seed for ``stream`` (e.g. ``"data"``) at ``keys`` (e.g. round, client).

    Each (seed, stream, keys) gets its own stream, so a client's randomness in a round does not
    depend on which other tasks ran before it.
    """
    entropy = [int(seed) & 0xFFFFFFFF, zlib.crc32(stream.encode()), *(int(k) & 0xFFFFFFFF for k in keys)]
    state = np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0]
    return int(state >> np.uint64(1))
