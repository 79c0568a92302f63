"""A scratch directory that every rank of a test world sees, for cases that write files."""
import contextlib
import shutil
import tempfile

import numpy as np

import axonhpc as ax


@contextlib.contextmanager
def shared_dir(world, prefix="axonhpc-"):
    """Rank 0 makes the directory and sends its name; every rank gets it; removed once every rank is done."""
    path = tempfile.mkdtemp(prefix=prefix) if world.rank == 0 else None
    text = np.frombuffer((path or "").ljust(256).encode(), dtype=np.uint8).copy()
    ax.broadcast(text, 0)
    path = text.tobytes().decode().strip()
    try:
        yield path
    finally:
        ax.barrier()
        if world.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
