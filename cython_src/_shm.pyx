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
2. copy the chunk into this rank's slot, all but this rank's own share (a
   cache-line aligned ``1/p`` of the chunk), which no other rank reads;
   publish *copied* = g + 1;
3. wait until every rank has copied;
4. reduce this rank's share over all ranks (its own part read from the
   caller's array, the others' from their slots), in rank order 0, 1, ...,
   p-1, into this rank's slot and the caller's array at once; publish
   *reduced*;
5. wait until every rank has reduced; copy the other ranks' shares out of
   their slots into the caller's array; publish *done*.

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

[Note: agreement on every call]
Every call carries a descriptor of four integers (``describe``: the kind of
collective, the caller's dtype, the reduce op, the element count, the root,
a code of the shape, and whether this rank runs the call through the engine
or only checks it here before MPI carries it). Each rank publishes it with
the call's first chunk and compares the others' after the wait it makes
anyway, so the check costs a few stores and one cache line read per peer.
Ranks that disagree all return ``AX_MISMATCH`` at the same chunk, having
moved no data, and ``Engine`` raises ``EngineMismatch``; the caller then
explains the disagreement on every rank.
"""
import zlib

from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.stdint cimport int32_t, int64_t, uint64_t
from libc.string cimport memset
cimport numpy as cnp

from _buffers cimport NOGIL_MIN_BYTES

import numpy as np

from axonhpc.errors import CollectiveMismatchError, CollectiveTimeoutError

cnp.import_array()

cdef extern from "byte_copy.h" nogil:
    void ax_copy(void* dst, const void* src, size_t n)

cdef extern from "shm_engine.h":
    enum: AX_MAX_RANKS
    enum: AX_CTRL_BYTES
    enum: AX_MAX_SLOTS
    enum: AX_DESC_WORDS
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
        int abandon
    ctypedef struct ax_op:
        int phase
        int rc
        int checked
        int64_t loose
        int64_t seen
    enum:
        AX_OP_ALLREDUCE
        AX_OP_REDUCE_SCATTER
        AX_OP_BROADCAST
        AX_OP_ALLGATHER
        AX_OP_ALLREDUCE_DIRECT
        AX_OP_ALLGATHER_DIRECT
        AX_OP_AGREE
    enum: AX_PHASE_DONE
    int ax_op_init(ax_op *o, ax_shm *s, int kind, char *x, char *out, size_t count, int dtype, int op,
                   size_t itemsize, int root, size_t offset, const int64_t *desc) nogil
    int ax_step(ax_shm *s, ax_op *o) nogil
    int ax_step_spinning(ax_shm *s, ax_op *o, long spins) nogil
    int ax_run(ax_shm *s, ax_op *o, double timeout, unsigned char *lagging) nogil
    void ax_lagging(ax_shm *s, const ax_op *o, unsigned char *lagging) nogil
    void ax_op_moved(ax_op *o) nogil

CTRL_BYTES = AX_CTRL_BYTES
MAX_RANKS = AX_MAX_RANKS
MAX_SLOTS = AX_MAX_SLOTS  # the descriptors' ring after the counters holds one entry per slot
# The dtypes and operations the kernels reduce (the backend contract's set).
DTYPES = {np.dtype(np.float32): 0, np.dtype(np.float64): 1, np.dtype(np.int32): 2, np.dtype(np.int64): 3,
          np.dtype(np.uint8): 4}
OPS = {"SUM": 0, "PRODUCT": 1, "MIN": 2, "MAX": 3, "AVG": 4}  # AVG: float dtypes only (sum, then / size)


cdef char* _address(cnp.ndarray a):
    return <char*>cnp.PyArray_DATA(a)


# -- descriptors (see [Note: agreement on every call]) --------------------------------------
# The kinds of collective, and the reduce ops by ReduceOp name (0: none).
# graph: the replay of a CUDA graph's collectives (``collectives.graphed``); refused: a rank that refused its
# call (a bad argument) before anything was sent, so the others hear it (``collectives.agreement.refused``).
# An all-reduce by another algorithm is another call: its parts (point to point, sub-groups) meet no native one.
KINDS = {"all_reduce": 1, "reduce_scatter": 2, "broadcast": 3, "all_gather": 4, "gather": 5, "scatter": 6,
         "barrier": 7, "graph": 8, "refused": 9, "all_reduce ring": 10, "all_reduce rhd": 11,
         "all_reduce hierarchical": 12}
DESC_OPS = {"SUM": 1, "PRODUCT": 2, "MIN": 3, "MAX": 4, "AVG": 5}
DEVICE = 1 << 24  # the dtype code's flag for an array in GPU memory
ELSEWHERE = 1 << 25  # this rank only checks the call here; another transport carries it
NONBLOCKING = 1 << 26  # ... and makes it as a nonblocking call ([Note: blocking and nonblocking twins], ``agree``)
cdef int64_t _MASK = (1 << 62) - 1  # every word stays below 2**62, so -word fits too (the MPI check's MAX)
cdef dict _DTYPE_CODES = {}


cdef object _last_dtype = None  # the hot path asks about one dtype again and again: identity first
cdef int64_t _last_code = 0


cpdef int64_t dtype_code(object dtype) except -1:
    """A number for ``dtype``, the same in every process: crc32 of its name and byte layout, 16 bits."""
    global _last_dtype, _last_code
    if dtype is _last_dtype:
        return _last_code
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        d = np.dtype(dtype)
        code = (zlib.crc32(f"{d.name}/{d.str}".encode()) & 0xFFFF) + 1
        _DTYPE_CODES[dtype] = code
    _last_dtype, _last_code = dtype, code
    return code


cdef inline void _describe(int64_t *w, int64_t kind, int64_t dcode, int64_t op, int64_t count, int ndim,
                           cnp.npy_intp *dims, int64_t root) noexcept:
    cdef uint64_t h = 1469598103934665603ULL  # FNV-1a over the dimensions
    cdef int k
    h = (h ^ <uint64_t>ndim) * 1099511628211ULL
    for k in range(ndim):
        h = (h ^ <uint64_t>dims[k]) * 1099511628211ULL
    w[0] = kind | (op << 4) | (dcode << 8)
    w[1] = count & _MASK
    w[2] = root + 1
    w[3] = <int64_t>(h & <uint64_t>_MASK)


def describe(str kind, dtype=None, shape=(), reduce=None, int root=-1, bint device=False, bint elsewhere=False):
    """The four words that say what a call is (see [Note: agreement on every call]).

    Args:
        kind: a key of ``KINDS``.
        dtype, shape: the caller's array (the dtype before any widening), or None and ().
        reduce: a ReduceOp name, or None.
        root: the root's group rank, or -1.
        device: the array lives in GPU memory.
        elsewhere: this rank only checks here; MPI (or NCCL) carries the call.
    """
    cdef int64_t w[4]
    cdef cnp.npy_intp dims[32]
    cdef int k, ndim = len(shape)
    cdef int64_t count = 1
    if ndim > 32:
        ndim = 32
    for k in range(ndim):
        dims[k] = shape[k]
        count *= shape[k]
    dcode = 0 if dtype is None else dtype_code(dtype) | (DEVICE if device else 0)
    _describe(w, KINDS[kind], dcode | (ELSEWHERE if elsewhere else 0), DESC_OPS.get(reduce, 0),
              count if dtype is not None else 0, ndim, dims, root)
    return (w[0], w[1], w[2], w[3])


def put_words(tuple desc not None, cnp.ndarray buf not None):
    """Write ``desc`` and its negation into ``buf`` (eight int64): what the MPI check reduces with MAX."""
    cdef int64_t *b = <int64_t*>cnp.PyArray_DATA(buf)
    cdef int k
    if buf.dtype != np.int64 or buf.size != 2 * AX_DESC_WORDS or not buf.flags.c_contiguous:
        raise ValueError("put_words: the buffer must be 8 contiguous int64")
    for k in range(AX_DESC_WORDS):
        b[k] = desc[k]
        b[AX_DESC_WORDS + k] = -b[k]


def words_agree(tuple desc not None, cnp.ndarray buf not None):
    """True if ``buf``, reduced with MAX over the ranks after ``put_words``, shows every rank sent ``desc``."""
    cdef int64_t *b = <int64_t*>cnp.PyArray_DATA(buf)
    cdef int k
    cdef int64_t v
    for k in range(AX_DESC_WORDS):
        v = desc[k]
        if b[k] != v or b[AX_DESC_WORDS + k] != -v:
            return False
    return True


# -- a small all-reduce that carries its check (``collectives.carried``) ------------------------
cdef inline int _put_vote(char *b, int t, double vote) except -1:
    if t == cnp.NPY_FLOAT32:
        (<float*>b)[0] = <float>vote
    elif t == cnp.NPY_FLOAT64:
        (<double*>b)[0] = vote
    elif t == cnp.NPY_INT32:
        (<int32_t*>b)[0] = <int32_t>vote
    elif t == cnp.NPY_INT64:
        (<int64_t*>b)[0] = <int64_t>vote
    else:
        raise ValueError("carry: the buffer must be float32, float64, int32 or int64")
    return 0


cdef inline double _vote(const char *b, int t) noexcept:
    if t == cnp.NPY_FLOAT32:
        return (<const float*>b)[0]
    if t == cnp.NPY_FLOAT64:
        return (<const double*>b)[0]
    if t == cnp.NPY_INT32:
        return (<const int32_t*>b)[0]
    return <double>(<const int64_t*>b)[0]


cdef char* _body_of(cnp.ndarray buf, object x) except? NULL:
    """``x``'s data, checked to fill ``buf`` after its first element (NULL for None)."""
    if not cnp.PyArray_IS_C_CONTIGUOUS(buf) or cnp.PyArray_SIZE(buf) < 1:
        raise ValueError("carry: the buffer must be contiguous and hold the vote")
    if x is None:
        return NULL
    if not isinstance(x, np.ndarray):
        raise TypeError(f"carry: x must be a numpy array, not {type(x).__name__}")
    cdef cnp.ndarray a = <cnp.ndarray>x
    if (cnp.PyArray_TYPE(a) != cnp.PyArray_TYPE(buf) or cnp.PyArray_SIZE(a) != cnp.PyArray_SIZE(buf) - 1
            or not cnp.PyArray_IS_C_CONTIGUOUS(a) or not cnp.PyArray_ISWRITEABLE(a)):
        raise ValueError(f"carry: x ({a.dtype}, {a.size} elements) must be a writable contiguous array of "
                         f"{buf.size - 1} {buf.dtype}")
    return <char*>cnp.PyArray_DATA(a)


cdef inline bint _carry_out(cnp.ndarray buf, char *dst, double all_yes) noexcept:
    cdef char *b = <char*>cnp.PyArray_DATA(buf)
    cdef size_t item = cnp.PyArray_ITEMSIZE(buf)
    if _vote(b, cnp.PyArray_TYPE(buf)) != all_yes:
        return False
    if dst != NULL:
        ax_copy(dst, b + item, cnp.PyArray_NBYTES(buf) - item)
    return True


cdef int _carry_in(cnp.ndarray buf, char *src, double vote) except -1:
    cdef char *b = <char*>cnp.PyArray_DATA(buf)
    cdef size_t item = cnp.PyArray_ITEMSIZE(buf)
    if src == NULL:
        memset(b, 0, cnp.PyArray_NBYTES(buf))
    else:
        ax_copy(b + item, src, cnp.PyArray_NBYTES(buf) - item)
    return _put_vote(b, cnp.PyArray_TYPE(buf), vote)


def carry_in(cnp.ndarray buf not None, object x, double vote):
    """Write ``vote`` and then the elements of ``x`` (any shape, C order; zeros for None) into ``buf``: a fused
    call's message."""
    _carry_in(buf, _body_of(buf, x), vote)


def carry_out(cnp.ndarray buf not None, object x, double all_yes):
    """After the reduction: True if ``buf``'s vote is ``all_yes``, and then ``x`` (not None) takes the result."""
    return _carry_out(buf, _body_of(buf, x), all_yes)


def carry(cnp.ndarray buf not None, object x, object reduce, double vote, double all_yes):
    """``carry_in``, ``reduce()`` (a blocking all-reduce of ``buf``), ``carry_out``: one fused call."""
    cdef char *data = _body_of(buf, x)
    _carry_in(buf, data, vote)
    reduce()
    return _carry_out(buf, data, all_yes)


# -- float MIN and MAX of two buffers, as the engine reduces them (``backends.folding``) ------------
cdef extern from "shm_engine.h":
    void ax_fold_min_f32(char *inout, const char *src, size_t n) noexcept nogil
    void ax_fold_max_f32(char *inout, const char *src, size_t n) noexcept nogil
    void ax_fold_min_f64(char *inout, const char *src, size_t n) noexcept nogil
    void ax_fold_max_f64(char *inout, const char *src, size_t n) noexcept nogil

ctypedef void (*_fold_fn)(char *inout, const char *src, size_t n) noexcept nogil


cdef class MinMax:
    """``inout = min(in, inout)`` (or max) elementwise on float32 or float64, as the engine reduces.

    The element function is the engine's (``shm_engine.h``): IEEE 754-2019 minimum and maximum, a NaN
    wins and -0.0 is below +0.0, so whatever folds with it gives the engine's bits, in any order.
    An instance is called as MPI calls a user op, ``kernel(inbuf, inoutbuf, datatype)`` (``datatype``
    unused), so it can be one (``MPI.Op.Create(MinMax("MIN", np.float32), commute=True)``); it takes
    any two contiguous buffers of equal length, numpy arrays too (their dtype is the caller's to check).

    Attributes:
        op: "MIN" or "MAX".
        dtype: float32 or float64, as a numpy dtype.

    Raises:
        ValueError: an op other than MIN or MAX, or a dtype other than float32 and float64 (at
            construction); buffers of different lengths, or not whole elements (at a call).
        BufferError, ValueError (the buffer's own refusal, numpy's is ValueError): a buffer that is not
            contiguous, or ``inout`` not writable.
    """

    cdef _fold_fn fn
    cdef Py_ssize_t itemsize
    cdef readonly str op
    cdef readonly object dtype

    def __init__(self, str op not None, dtype):
        dt = np.dtype(dtype)
        if op not in ("MIN", "MAX"):
            raise ValueError(f"MinMax: op {op!r} is not MIN or MAX")
        if dt == np.float32:
            self.fn = ax_fold_min_f32 if op == "MIN" else ax_fold_max_f32
        elif dt == np.float64:
            self.fn = ax_fold_min_f64 if op == "MIN" else ax_fold_max_f64
        else:
            raise ValueError(f"MinMax: float32 or float64, not {dt}")
        self.itemsize = dt.itemsize
        self.op, self.dtype = op, dt

    def __call__(self, inbuf, inoutbuf, datatype=None):
        cdef Py_buffer src, dst
        cdef _fold_fn fn = self.fn
        cdef size_t n
        PyObject_GetBuffer(inbuf, &src, PyBUF_SIMPLE)
        try:
            PyObject_GetBuffer(inoutbuf, &dst, PyBUF_WRITABLE)
            try:
                if src.len != dst.len or dst.len % self.itemsize:
                    raise ValueError(f"MinMax: {src.len} bytes into {dst.len}, in elements of {self.itemsize} "
                                     "bytes")
                n = <size_t>(dst.len // self.itemsize)
                if dst.len < NOGIL_MIN_BYTES:
                    fn(<char*>dst.buf, <const char*>src.buf, n)
                else:
                    with nogil:
                        fn(<char*>dst.buf, <const char*>src.buf, n)
            finally:
                PyBuffer_Release(&dst)
        finally:
            PyBuffer_Release(&src)

    def __repr__(self):
        return f"MinMax({self.op!r}, {self.dtype})"


class EngineMismatch(CollectiveMismatchError):
    """The ranks of a node disagreed about a call (its descriptor); nothing was moved.

    The engine's own refusal; the collectives layer catches it and explains
    the difference on every rank.
    """


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
        check: compare every call's descriptor across the ranks (the
            default; off only to measure what the check costs).
    """

    cdef ax_shm s
    cdef unsigned char _lagging[256]
    cdef public double timeout
    cdef public bint check
    cdef object _verdict
    cdef list _queue  # the nonblocking calls in flight (EngineOp), oldest first

    def __init__(self, addresses, int rank, Py_ssize_t slot_bytes, int nslots):
        cdef Py_ssize_t k, size = len(addresses)
        if not 1 <= size <= AX_MAX_RANKS:
            raise ValueError(f"the shared-memory engine takes 1 to {AX_MAX_RANKS} ranks, got {size}")
        if not 0 <= rank < size or slot_bytes < 64 * size or slot_bytes % 64 or not 1 <= nslots <= AX_MAX_SLOTS:
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
        self.check = True
        self._queue = []

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

    @property
    def busy(self):
        """True while nonblocking calls are in flight (``progress`` steps them)."""
        return bool(self._queue)

    def abandon(self, error):
        """Make the call waiting in this engine (from another thread: the watchdog) give up and raise ``error``.

        The engine's counters are then out of step with the other ranks': it is not used again.
        """
        self._verdict = error
        self.s.abandon = 1

    @property
    def verdict(self):
        """The error ``abandon`` was given, or None."""
        return self._verdict if self.s.abandon else None

    cdef _check(self, int code, str what):
        cdef int k
        if code == -1 and self._verdict is not None:
            raise self._verdict  # the watchdog's verdict (a deadlock, a stall that did not end)
        if code == -1:
            missing = [k for k in range(self.s.size) if self._lagging[k]]
            error = CollectiveTimeoutError(
                f"shared-memory {what} timed out after {self.timeout:g} s; missing ranks (of this node's "
                f"group): {missing}")
            error.missing = missing
            raise error
        if code == -3:
            raise EngineMismatch(f"shared-memory {what}: the ranks of this node disagree about the call")
        if code != 0:
            raise ValueError(f"shared-memory {what}: unsupported dtype, operation or geometry")

    cdef object _go(self, ax_op *o, int init_code, str what, bint later, object keep):
        """Make the call ``o``: at once (blocking), or (``later``) queued as an ``EngineOp``, which it returns."""
        cdef int code
        cdef double timeout = self.timeout
        cdef EngineOp call
        self._check(init_code, what)
        if not later:
            if self._queue:
                raise RuntimeError(f"shared-memory {what}: a blocking call while nonblocking ones are in flight "
                                   "(the caller must queue it after them)")
            with nogil:
                code = ax_run(&self.s, o, timeout, self._lagging)
            self._check(code, what)
            return None
        call = EngineOp.__new__(EngineOp)
        call.o = o[0]
        ax_op_moved(&call.o)
        call.engine = self
        call.what = what
        call.keep = keep
        self._queue.append(call)
        return call

    def progress(self, long spins=0):
        """Step the calls in flight, oldest first, as far as they go without waiting; True once none is left.

        ``spins``: busy polls of what the oldest waits for before giving up (a wait's, to stay in C a while).
        A call that ended is taken off the queue; its ``EngineOp`` says how it ended.
        """
        cdef EngineOp head
        cdef int finished
        while self._queue:
            head = <EngineOp>self._queue[0]
            with nogil:
                finished = ax_step_spinning(&self.s, &head.o, spins)
            if not finished:
                return False
            del self._queue[0]
        return True

    def agree(self, tuple desc not None, bint nonblocking=False, bint later=False):
        """One step that moves nothing: raise ``EngineMismatch`` unless every rank passes the same ``desc``.

        ``nonblocking``: this rank makes the call (which another transport carries) as a nonblocking one; the
        ranks may differ in that. Returns True if some rank does ([Note: blocking and nonblocking twins]);
        ``later``: the queued ``EngineOp`` instead, whose ``seen`` says so once done.
        """
        cdef int64_t w[4]
        cdef ax_op o
        cdef int code
        _fill(w, desc, 0, None, 0, -1)
        if nonblocking:
            w[0] |= NONBLOCKING << 8
        code = ax_op_init(&o, &self.s, AX_OP_AGREE, NULL, NULL, 0, 0, 0, 1, -1, 0, w)
        o.loose = NONBLOCKING << 8
        call = self._go(&o, code, "agreement check", later, None)
        return call if later else o.seen != 0

    def all_reduce(self, cnp.ndarray x not None, str op, tuple desc=None, bint later=False):
        """Reduce ``x`` (C-contiguous, a kernel dtype) over the node's ranks, in place.

        ``desc``: the call's descriptor (``describe``), when ``x`` is not the
        caller's own array (a widened copy); by default it is taken from ``x`` and ``op``.
        ``later``: queue the call and return its ``EngineOp`` (``x`` must stay untouched until it is done).
        """
        cdef int64_t w[4]
        cdef ax_op o
        cdef int code
        if self.check:
            _fill(w, desc, 1, x, DESC_OPS[op], -1)
        code = ax_op_init(&o, &self.s, AX_OP_ALLREDUCE, _address(x), NULL, <size_t>x.size, DTYPES[x.dtype], OPS[op],
                          <size_t>x.itemsize, -1, 0, w if self.check else NULL)
        return self._go(&o, code, "all_reduce", later, x)

    def reduce_scatter(self, cnp.ndarray x not None, cnp.ndarray out not None, str op, tuple desc=None,
                       bint later=False):
        """``out`` = the reduction over the ranks of block ``rank`` of ``x`` (``size`` blocks of ``out.size``)."""
        cdef int64_t w[4]
        cdef ax_op o
        cdef int code
        if self.check:
            _fill(w, desc, 2, x, DESC_OPS[op], -1)
        code = ax_op_init(&o, &self.s, AX_OP_REDUCE_SCATTER, _address(x), _address(out), <size_t>out.size,
                          DTYPES[x.dtype], OPS[op], <size_t>x.itemsize, -1, 0, w if self.check else NULL)
        return self._go(&o, code, "reduce_scatter", later, (x, out))

    cdef size_t _offset_in_window(self, cnp.ndarray x, str what) except? 0:
        cdef char* data = _address(x)
        cdef char* base = self.s.segs[self.s.rank]
        if data < base or data + <size_t>x.nbytes > base + self.s.slot_bytes * self.s.nslots:
            raise ValueError(f"{what}: the array does not lie in this rank's segment")
        return <size_t>(data - base)

    def all_reduce_in_window(self, cnp.ndarray x not None, str op, tuple desc=None, bint later=False):
        """Reduce ``x``, which lies in this rank's segment, over the node in place, with no copy in.

        Every rank passes the array at the same offset of its own segment
        (a buffer the window allocated); see ``ax_step_allreduce_direct``.
        """
        cdef int64_t w[4]
        cdef ax_op o
        cdef int code
        cdef size_t offset = self._offset_in_window(x, "all_reduce_in_window")
        if self.check:
            _fill(w, desc, 1, x, DESC_OPS[op], -1)
            w[2] += <int64_t>offset << 16  # and every rank's array at the same offset
        code = ax_op_init(&o, &self.s, AX_OP_ALLREDUCE_DIRECT, NULL, NULL, <size_t>x.size, DTYPES[x.dtype], OPS[op],
                          <size_t>x.itemsize, -1, offset, w if self.check else NULL)
        return self._go(&o, code, "all_reduce", later, x)

    def all_gather(self, cnp.ndarray x not None, cnp.ndarray out not None, tuple desc=None, bint later=False):
        """``out`` = every rank's ``x`` in rank order (both C-contiguous; ``out`` holds size x ``x.nbytes``)."""
        cdef int64_t w[4]
        cdef ax_op o
        cdef int code
        if <size_t>out.nbytes != <size_t>x.nbytes * <size_t>self.s.size:
            raise ValueError(f"all_gather: out holds {out.nbytes} bytes, not {self.s.size} x {x.nbytes}")
        if self.check:
            _fill(w, desc, 4, x, 0, -1)
        code = ax_op_init(&o, &self.s, AX_OP_ALLGATHER, _address(x), _address(out), <size_t>x.nbytes, 0, 0, 1, -1, 0,
                          w if self.check else NULL)
        return self._go(&o, code, "all_gather", later, (x, out))

    def all_gather_in_window(self, cnp.ndarray x not None, cnp.ndarray out not None, tuple desc=None,
                             bint later=False):
        """``out`` = every rank's ``x``, read where it lies in each rank's segment (no copy in).

        Every rank passes the array at the same offset of its own segment, like
        ``all_reduce_in_window``; ``out`` is any C-contiguous array of size x ``x.nbytes``.
        """
        cdef int64_t w[4]
        cdef ax_op o
        cdef int code
        cdef size_t offset = self._offset_in_window(x, "all_gather_in_window")
        if <size_t>out.nbytes != <size_t>x.nbytes * <size_t>self.s.size:
            raise ValueError(f"all_gather_in_window: out holds {out.nbytes} bytes, not {self.s.size} x {x.nbytes}")
        if self.check:
            _fill(w, desc, 4, x, 0, -1)
            w[2] += <int64_t>offset << 16  # and every rank's array at the same offset
        code = ax_op_init(&o, &self.s, AX_OP_ALLGATHER_DIRECT, NULL, _address(out), <size_t>x.nbytes, 0, 0, 1, -1,
                          offset, w if self.check else NULL)
        return self._go(&o, code, "all_gather", later, (x, out))

    def broadcast(self, cnp.ndarray x not None, int root, tuple desc=None, bint later=False):
        """Copy ``root``'s ``x`` into ``x`` on every rank."""
        cdef int64_t w[4]
        cdef ax_op o
        cdef int code
        if not 0 <= root < self.s.size:
            raise ValueError(f"broadcast: root {root} is not a rank of this node's {self.s.size}")
        if self.check:
            _fill(w, desc, 3, x, 0, root)
        code = ax_op_init(&o, &self.s, AX_OP_BROADCAST, _address(x), NULL, <size_t>x.nbytes, 0, 0, 1, root, 0,
                          w if self.check else NULL)
        return self._go(&o, code, "broadcast", later, x)


cdef class EngineOp:
    """A nonblocking call of an ``Engine``, in flight until ``done``: ``Engine.progress`` steps it.

    The arrays it reads and writes are kept alive with it; the caller leaves them untouched until it is done.

    Attributes:
        what: the collective, as errors name it ("all_reduce", "agreement check").
    """

    cdef ax_op o
    cdef Engine engine
    cdef object keep
    cdef readonly str what

    @property
    def done(self):
        """True once the call ended (well or not: ``result`` says)."""
        return self.o.phase == AX_PHASE_DONE

    @property
    def failed(self):
        """True once the call ended with an error (``result`` raises it)."""
        return self.o.phase == AX_PHASE_DONE and self.o.rc != 0

    @property
    def checked(self):
        """True once every rank was found making the same call (or it is not compared): it will not be refused."""
        return self.o.checked != 0

    @property
    def seen(self):
        """An agreement step's answer: some rank makes the call nonblocking."""
        return self.o.seen != 0

    def result(self):
        """Raise what the call ended with (``EngineMismatch``, ``ValueError``), if anything; it must be done."""
        self.engine._check(self.o.rc, self.what)

    def lagging(self):
        """The ranks (of this node's group) this call waits for now; empty once done."""
        cdef unsigned char behind[256]
        cdef int k
        ax_lagging(&self.engine.s, &self.o, behind)
        return [k for k in range(self.engine.s.size) if behind[k]]


cdef int _fill(int64_t *w, tuple desc, int64_t kind, cnp.ndarray x, int64_t op, int64_t root) except -1:
    """``desc`` into ``w``, or (None) the descriptor of a call on the caller's own ``x``."""
    if desc is not None:
        if len(desc) != 4:
            raise ValueError(f"a call's descriptor is four integers (see describe), got {desc!r}")
        w[0], w[1], w[2], w[3] = desc[0], desc[1], desc[2], desc[3]
        return 0
    _describe(w, kind, dtype_code(x.dtype), op, x.size, x.ndim, cnp.PyArray_DIMS(x), root)
    return 0
