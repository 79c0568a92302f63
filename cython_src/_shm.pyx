"""Intra-node collectives through a shared-memory window: the compiled engine.

[Note: the shared-memory protocol]
Every rank of a node maps every other rank's segment (``MPI.Win.Allocate_shared``
on the node's communicator; ``axonhpc.backends.shm`` sets it up). A segment is
a control block of three counters (chunks this rank has *copied* in, *reduced*,
and is *done* with), written only by its owner with release stores and read
by the others with acquire loads, followed by ``nslots`` slots of
``slot_bytes``. A message passes through the slots chunk by chunk, chunk g in
slot ``g % nslots``; all-reduce of one chunk:

1. wait until every rank is done with chunk ``g - nslots`` (the slot is free);
2. copy the chunk into this rank's slot; publish *copied* = g + 1;
3. wait until every rank has copied;
4. reduce this rank's share of the chunk (a cache-line aligned ``1/p``) over
   all ranks' slots, in rank order 0, 1, ..., p-1, into this rank's slot;
   publish *reduced*;
5. wait until every rank has reduced; copy every rank's share out of its
   slot into the caller's array; publish *done*.

The memory touched per rank stays ``nslots * slot_bytes`` whatever the
message size, so the chunks stay in the last-level cache between the copy in,
the reduction and the copy out; a rank can copy chunk g + 1 in while a slower
one still reduces chunk g. The reduction order is fixed, so the result does
not depend on timing: the same inputs on the same number of ranks give the
same bits every run. Waits spin briefly, then yield the core, then sleep with
a growing delay (up to 0.2 ms): on an oversubscribed node the rank being
waited for needs the core. The counters grow by one per chunk and are
never reset, so the engine needs no barrier between calls.

Reduce-scatter and broadcast follow the same pattern (see
``shm_engine.h``). All loops run without the GIL.
"""
from libc.stdint cimport uint64_t
cimport numpy as cnp

import numpy as np

from axonhpc.errors import CollectiveTimeoutError

cnp.import_array()

cdef extern from "shm_engine.h":
    enum: AX_MAX_RANKS
    enum: AX_CTRL_BYTES
    ctypedef struct ax_ctrl:
        pass
    ctypedef struct ax_shm:
        int rank
        int size
        int nslots
        size_t slot_bytes
        char *segs[256]
        ax_ctrl *ctrls[256]
        uint64_t seq
        uint64_t waits
        double wait_seconds
        long spin_iters
        long yield_iters
    int ax_allreduce(ax_shm *s, char *x, size_t count, int dtype, int op, size_t itemsize,
                     double timeout, unsigned char *lagging) nogil
    int ax_reduce_scatter(ax_shm *s, const char *x, char *out, size_t block, int dtype, int op,
                          size_t itemsize, double timeout, unsigned char *lagging) nogil
    int ax_allreduce_direct(ax_shm *s, size_t offset, size_t count, int dtype, int op, size_t itemsize,
                            double timeout, unsigned char *lagging) nogil
    int ax_broadcast(ax_shm *s, char *x, size_t count, size_t itemsize, int root, double timeout,
                     unsigned char *lagging) nogil
    int ax_allgather(ax_shm *s, const char *x, char *out, size_t nbytes, double timeout,
                     unsigned char *lagging) nogil
    int ax_allgather_direct(ax_shm *s, size_t offset, size_t nbytes, char *out, double timeout,
                            unsigned char *lagging) nogil

CTRL_BYTES = AX_CTRL_BYTES
MAX_RANKS = AX_MAX_RANKS
# The dtypes and operations the kernels reduce (the backend contract's set).
DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.int32): 2, np.dtype(np.int64): 3,
          np.dtype(np.uint8): 4}
OPS = {"SUM": 0, "PRODUCT": 1, "MIN": 2, "MAX": 3, "AVG": 4}  # AVG: float dtypes only (sum, then / size)


cdef char* _address(cnp.ndarray a):
    return <char*>cnp.PyArray_DATA(a)


cdef class Engine:
    """The collectives of one node's ranks over their mapped segments.

    Args:
        addresses: the address of every rank's segment in this process, in rank order.
        rank: this rank's index in ``addresses``.
        slot_bytes: bytes of one slot (a multiple of 64).
        nslots: slots per segment.

    Attributes:
        timeout: seconds a wait for another rank may last before the call
            raises ``CollectiveTimeoutError`` (0: forever).
    """

    cdef ax_shm s
    cdef unsigned char _lagging[256]
    cdef public double timeout

    def __init__(self, addresses, int rank, Py_ssize_t slot_bytes, int nslots):
        cdef Py_ssize_t k, size = len(addresses)
        if not 1 <= size <= AX_MAX_RANKS:
            raise ValueError(f"the shared-memory engine takes 1 to {AX_MAX_RANKS} ranks, got {size}")
        if not 0 <= rank < size or slot_bytes < 64 * size or slot_bytes % 64 or nslots < 1:
            raise ValueError(f"bad engine geometry: rank {rank} of {size}, slot_bytes {slot_bytes}, nslots {nslots}")
        self.s.rank = rank
        self.s.size = <int>size
        self.s.nslots = nslots
        self.s.slot_bytes = <size_t>slot_bytes
        self.s.seq = 0
        self.s.waits = 0
        self.s.wait_seconds = 0.0
        self.s.spin_iters = 200
        self.s.yield_iters = 2000
        for k in range(size):
            self.s.ctrls[k] = <ax_ctrl*><size_t>addresses[k]
            self.s.segs[k] = <char*><size_t>addresses[k] + AX_CTRL_BYTES
        self.timeout = 0.0

    @property
    def chunks(self):
        """Chunks passed through the slots so far (equal on every rank)."""
        return self.s.seq

    def set_polling(self, long spin_iters, long yield_iters):
        """Busy polls before a wait yields the core, and polls before it starts to sleep."""
        self.s.spin_iters = max(spin_iters, 1)
        self.s.yield_iters = max(yield_iters, self.s.spin_iters)

    @property
    def wait_seconds(self):
        """Seconds this rank spent waiting for the others (for benchmarks)."""
        return self.s.wait_seconds

    @property
    def waits(self):
        """How many waits had to yield or sleep (a rank arrived late)."""
        return self.s.waits

    cdef _check(self, int code, str what):
        cdef int k
        if code == -1:
            missing = [k for k in range(self.s.size) if self._lagging[k]]
            error = CollectiveTimeoutError(
                f"shared-memory {what} timed out after {self.timeout:g} s; missing ranks (of this node's "
                f"group): {missing}")
            error.missing = missing
            raise error
        if code != 0:
            raise ValueError(f"shared-memory {what}: unsupported dtype, operation or geometry")

    def all_reduce(self, cnp.ndarray x not None, str op):
        """Reduce ``x`` (C-contiguous, a kernel dtype) over the node's ranks, in place."""
        cdef int dtype = DTYPES[x.dtype], code, opcode = OPS[op]
        cdef size_t count = <size_t>x.size, itemsize = <size_t>x.itemsize
        cdef char* data = _address(x)
        cdef double timeout = self.timeout
        with nogil:
            code = ax_allreduce(&self.s, data, count, dtype, opcode, itemsize, timeout, self._lagging)
        self._check(code, "all_reduce")

    def reduce_scatter(self, cnp.ndarray x not None, cnp.ndarray out not None, str op):
        """``out`` = the reduction over the ranks of block ``rank`` of ``x`` (``size`` blocks of ``out.size``)."""
        cdef int dtype = DTYPES[x.dtype], code, opcode = OPS[op]
        cdef size_t block = <size_t>out.size, itemsize = <size_t>x.itemsize
        cdef char* src = _address(x)
        cdef char* dst = _address(out)
        cdef double timeout = self.timeout
        with nogil:
            code = ax_reduce_scatter(&self.s, src, dst, block, dtype, opcode, itemsize, timeout, self._lagging)
        self._check(code, "reduce_scatter")

    def all_reduce_in_window(self, cnp.ndarray x not None, str op):
        """Reduce ``x``, which lies in this rank's segment, over the node in place, with no copy in.

        Every rank passes the array at the same offset of its own segment
        (a buffer the window allocated); see ``ax_allreduce_direct``.
        """
        cdef int dtype = DTYPES[x.dtype], code, opcode = OPS[op]
        cdef size_t count = <size_t>x.size, itemsize = <size_t>x.itemsize
        cdef char* data = _address(x)
        cdef char* base = self.s.segs[self.s.rank]
        cdef double timeout = self.timeout
        if data < base or data + count * itemsize > base + self.s.slot_bytes * self.s.nslots:
            raise ValueError("all_reduce_in_window: the array does not lie in this rank's segment")
        with nogil:
            code = ax_allreduce_direct(&self.s, <size_t>(data - base), count, dtype, opcode, itemsize, timeout,
                                       self._lagging)
        self._check(code, "all_reduce")

    def all_gather(self, cnp.ndarray x not None, cnp.ndarray out not None):
        """``out`` = every rank's ``x`` in rank order (both C-contiguous; ``out`` holds size x ``x.nbytes``)."""
        cdef int code
        cdef size_t nbytes = <size_t>x.nbytes
        cdef char* src = _address(x)
        cdef char* dst = _address(out)
        cdef double timeout = self.timeout
        if <size_t>out.nbytes != nbytes * <size_t>self.s.size:
            raise ValueError(f"all_gather: out holds {out.nbytes} bytes, not {self.s.size} x {nbytes}")
        with nogil:
            code = ax_allgather(&self.s, src, dst, nbytes, timeout, self._lagging)
        self._check(code, "all_gather")

    def all_gather_in_window(self, cnp.ndarray x not None, cnp.ndarray out not None):
        """``out`` = every rank's ``x``, read where it lies in each rank's segment (no copy in).

        Every rank passes the array at the same offset of its own segment, like
        ``all_reduce_in_window``; ``out`` is any C-contiguous array of size x ``x.nbytes``.
        """
        cdef int code
        cdef size_t nbytes = <size_t>x.nbytes
        cdef char* data = _address(x)
        cdef char* dst = _address(out)
        cdef char* base = self.s.segs[self.s.rank]
        cdef double timeout = self.timeout
        if data < base or data + nbytes > base + self.s.slot_bytes * self.s.nslots:
            raise ValueError("all_gather_in_window: the array does not lie in this rank's segment")
        if <size_t>out.nbytes != nbytes * <size_t>self.s.size:
            raise ValueError(f"all_gather_in_window: out holds {out.nbytes} bytes, not {self.s.size} x {nbytes}")
        with nogil:
            code = ax_allgather_direct(&self.s, <size_t>(data - base), nbytes, dst, timeout, self._lagging)
        self._check(code, "all_gather")

    def broadcast(self, cnp.ndarray x not None, int root):
        """Copy ``root``'s ``x`` into ``x`` on every rank."""
        cdef int code
        cdef size_t count = <size_t>x.nbytes
        cdef char* data = _address(x)
        cdef double timeout = self.timeout
        with nogil:
            code = ax_broadcast(&self.s, data, count, 1, root, timeout, self._lagging)
        self._check(code, "broadcast")
