"""Arrays for the compiled-buffer tests: every supported dtype, exactly representable values."""
import numpy as np

from axonhpc._dtypes import supported_dtypes

DTYPES = supported_dtypes()
DTYPE_IDS = [str(d) for d in DTYPES]


def make(shape, dtype, rng):
    """Random array of ``shape`` whose values ``dtype`` holds exactly (no rounding surprises)."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return np.asarray(rng.integers(0, 100, size=shape), dtype=dtype)
    return np.asarray(rng.integers(-1000, 1000, size=shape) / 8, dtype=dtype)
