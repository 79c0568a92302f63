/* Intra-node collectives over memory that every rank of a node maps (an MPI-3
 * shared window). Used by _shm.pyx; the protocol is described there.
 *
 * Each rank owns one segment: a control block (three counters, written only by
 * their owner, read by everyone) followed by NSLOTS slots of SLOT_BYTES. A
 * message is cut into chunks that pass through the slots in turn, so the
 * memory in use stays fixed (and in the last-level cache) whatever the
 * message size, and one rank can copy chunk g+1 in while another still
 * reduces chunk g.
 */
#ifndef AXONHPC_SHM_ENGINE_H
#define AXONHPC_SHM_ENGINE_H

#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#include "byte_copy.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define AX_CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define AX_CPU_RELAX() __asm__ __volatile__("yield" ::: "memory")
#else
#define AX_CPU_RELAX() do { } while (0)
#endif

/* One rank's counters: chunks it has copied in, reduced, and finished with. */
typedef struct {
    uint64_t copied;
    uint64_t reduced;
    uint64_t done;
    uint64_t pad[5]; /* a cache line of its own */
} ax_ctrl;

enum { AX_COPIED = 0, AX_REDUCED = 1, AX_DONE = 2 };
enum { AX_F32 = 0, AX_F64 = 1, AX_I32 = 2, AX_I64 = 3, AX_U8 = 4 };
enum { AX_SUM = 0, AX_PROD = 1, AX_MIN = 2, AX_MAX = 3, AX_AVG = 4 };
#define AX_MAX_RANKS 256
#define AX_CTRL_BYTES 4096 /* the control block's share of a segment (keeps the slots page-aligned) */

/* What a call is, as every rank must agree on it (kind, dtype, op, element
 * count, root, shape): written by the caller, compared by the engine. Each
 * rank publishes its call's descriptor with the first chunk of the call, in a
 * ring after its counters (entry g % nslots for chunk g), and checks every
 * other rank's once they have all copied that chunk in. The entry of chunk g is
 * rewritten no sooner than chunk g + nslots, whose slot is free only once every
 * rank is done with chunk g, and a rank is done with a chunk only after it has
 * read the descriptors: so what a rank reads is its peer's call, never a later
 * one. A descriptor that differs on any rank is seen by every rank at the
 * same chunk; each then completes that chunk's steps without touching the data
 * and returns AX_MISMATCH, so the counters stay in step and the engine can be
 * used again. A NULL descriptor skips the check (settings.check_collectives off). */
#define AX_DESC_WORDS 4
typedef struct {
    uint64_t g;                    /* the chunk this call began at */
    int64_t w[AX_DESC_WORDS];
    uint64_t pad[3];               /* a cache line each */
} ax_desc;
#define AX_MAX_SLOTS ((AX_CTRL_BYTES - (int)sizeof(ax_ctrl)) / (int)sizeof(ax_desc))
#define AX_MISMATCH (-3)

typedef struct {
    int rank;
    int size;
    int nslots;
    size_t slot_bytes;
    char *segs[AX_MAX_RANKS];      /* each rank's first slot */
    ax_ctrl *ctrls[AX_MAX_RANKS];  /* each rank's counters */
    uint64_t seq;                  /* chunks passed through the slots so far (equal on every rank) */
    uint64_t waits;                /* how often a wait had to yield or sleep (for benchmarks) */
    double wait_seconds;           /* time spent waiting for other ranks (for benchmarks) */
    long spin_iters;               /* busy polls before the first yield */
    long yield_iters;              /* polls (spins included) before the first sleep */
    volatile int abandon;          /* set by another thread (the watchdog): the waits give up as on a timeout */
} ax_shm;

static inline uint64_t ax_load(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static inline void ax_store(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

static inline uint64_t *ax_field(ax_ctrl *c, int field) {
    return field == AX_COPIED ? &c->copied : field == AX_REDUCED ? &c->reduced : &c->done;
}

static inline double ax_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Wait until every rank's counter `field` is at least `target`.
 * Spins briefly, then yields the core, then sleeps with a growing delay: on an
 * oversubscribed node the rank being waited for needs the core.
 * Returns 0, or -1 after `timeout` seconds (timeout <= 0: never), or once `abandon` is set, with
 * lagging[r] set for every rank r still behind. */
static int ax_wait_all(ax_shm *s, int field, uint64_t target, double timeout, unsigned char *lagging) {
    long iter = 0;
    double start = 0.0, entered = 0.0;
    long sleep_ns = 2000;
    for (;;) {
        int behind = -1;
        for (int r = 0; r < s->size; r++) {
            if (ax_load(ax_field(s->ctrls[r], field)) < target) { behind = r; break; }
        }
        if (behind < 0) {
            if (iter) s->wait_seconds += ax_now() - entered;
            return 0;
        }
        if (iter == 0) entered = ax_now();
        iter++;
        if (iter < s->spin_iters) { AX_CPU_RELAX(); continue; }
        if (iter == s->spin_iters) { s->waits++; start = ax_now(); }
        if (iter < s->yield_iters) {
            sched_yield();
        } else {
            struct timespec ts = {0, sleep_ns};
            nanosleep(&ts, NULL);
            if (sleep_ns < 200000) sleep_ns += sleep_ns / 4;
        }
        if ((iter & 63) == 0 && ((timeout > 0 && ax_now() - start > timeout) || s->abandon)) {
            for (int r = 0; r < s->size; r++)
                lagging[r] = ax_load(ax_field(s->ctrls[r], field)) < target;
            return -1;
        }
    }
}


/* dst[i] = src[0][i] op src[1][i] op ... in rank order, blockwise through a small
 * accumulator, so dst may be one of the sources; the same into dst2 too unless
 * it is NULL (it may be a source as well). */
#define AX_BLOCK 1024
#define AX_DEFINE_REDUCE(NAME, T, EXPR, FINISH)                                      \
    static void NAME(char *dst, char *dst2, char *const *srcs, int p, size_t n) {    \
        T acc[AX_BLOCK];                                                              \
        for (size_t b = 0; b < n; b += AX_BLOCK) {                                    \
            size_t m = n - b < AX_BLOCK ? n - b : AX_BLOCK;                           \
            const T *s0 = (const T *)srcs[0] + b;                                     \
            for (size_t i = 0; i < m; i++) acc[i] = s0[i];                            \
            for (int r = 1; r < p; r++) {                                             \
                const T *sr = (const T *)srcs[r] + b;                                 \
                for (size_t i = 0; i < m; i++) { T a = acc[i], v = sr[i]; acc[i] = (EXPR); } \
            }                                                                         \
            FINISH                                                                    \
            ax_copy((T *)dst + b, acc, m * sizeof(T));                                \
            if (dst2) ax_copy((T *)dst2 + b, acc, m * sizeof(T));                     \
        }                                                                             \
    }

/* AVG of floats: the sum in rank order, then one correctly rounded division by
 * p (numpy's `sum / p`, so the bits equal the MPI path's sum-then-divide). */
#define AX_DIVIDE(T) for (size_t i = 0; i < m; i++) acc[i] = acc[i] / (T)p;

/* MIN and MAX of floats are IEEE 754-2019 minimum and maximum: a NaN from any
 * rank wins (a NaN accumulator stays: every comparison with it is false; a NaN v
 * is taken: v != v), and -0 is below +0. On a tie (v == a: equal numbers, which
 * have equal bits, or two zeros) MIN ORs the bits, so a sign from either side
 * makes -0, and MAX ANDs them, so +0 unless both are -0. That makes both
 * commutative and associative bit for bit (which NaN comes out aside), so every
 * rank, every order and every path agree (MPI: backends/mpi_work.py; threads
 * and ring/rhd: backends/folding.py). The tie is taken on the bits, not with
 * signbit(): the f64 loops then vectorise without SSE4.2's 64-bit compare.
 * Integers keep the plain comparison. */
#define AX_DEFINE_IEEE_MINMAX(SUFFIX, T, U)                                \
    static inline T ax_fmin_##SUFFIX(T a, T v) {                           \
        T m = (v < a || v != v) ? v : a;                                   \
        U mb, vb;                                                          \
        memcpy(&mb, &m, sizeof mb);                                        \
        memcpy(&vb, &v, sizeof vb);                                        \
        mb |= (v == a) ? vb : (U)0;                                        \
        memcpy(&m, &mb, sizeof m);                                         \
        return m;                                                          \
    }                                                                      \
    static inline T ax_fmax_##SUFFIX(T a, T v) {                           \
        T m = (v > a || v != v) ? v : a;                                   \
        U mb, vb;                                                          \
        memcpy(&mb, &m, sizeof mb);                                        \
        memcpy(&vb, &v, sizeof vb);                                        \
        mb &= (v == a) ? vb : ~(U)0;                                       \
        memcpy(&m, &mb, sizeof m);                                         \
        return m;                                                          \
    }

AX_DEFINE_IEEE_MINMAX(f32, float, uint32_t)
AX_DEFINE_IEEE_MINMAX(f64, double, uint64_t)

/* inout[i] = F(inout[i], src[i]): one buffer folded into another (_shm.MinMax, MPI's user op). */
#define AX_DEFINE_FOLD(NAME, T, F)                                        \
    static void NAME(char *inout, const char *src, size_t n) {            \
        T *d = (T *)inout;                                                \
        const T *v = (const T *)src;                                      \
        for (size_t i = 0; i < n; i++) d[i] = F(d[i], v[i]);              \
    }
AX_DEFINE_FOLD(ax_fold_min_f32, float, ax_fmin_f32)
AX_DEFINE_FOLD(ax_fold_max_f32, float, ax_fmax_f32)
AX_DEFINE_FOLD(ax_fold_min_f64, double, ax_fmin_f64)
AX_DEFINE_FOLD(ax_fold_max_f64, double, ax_fmax_f64)

#define AX_DEFINE_OPS(SUFFIX, T, MIN, MAX)                  \
    AX_DEFINE_REDUCE(ax_sum_##SUFFIX, T, a + v, )           \
    AX_DEFINE_REDUCE(ax_prod_##SUFFIX, T, a * v, )          \
    AX_DEFINE_REDUCE(ax_min_##SUFFIX, T, MIN, )             \
    AX_DEFINE_REDUCE(ax_max_##SUFFIX, T, MAX, )
#define AX_INT_MIN (v < a ? v : a)
#define AX_INT_MAX (v > a ? v : a)

AX_DEFINE_OPS(f32, float, ax_fmin_f32(a, v), ax_fmax_f32(a, v))
AX_DEFINE_OPS(f64, double, ax_fmin_f64(a, v), ax_fmax_f64(a, v))
AX_DEFINE_OPS(i32, int32_t, AX_INT_MIN, AX_INT_MAX)
AX_DEFINE_OPS(i64, int64_t, AX_INT_MIN, AX_INT_MAX)
AX_DEFINE_OPS(u8, uint8_t, AX_INT_MIN, AX_INT_MAX)
AX_DEFINE_REDUCE(ax_avg_f32, float, a + v, AX_DIVIDE(float))
AX_DEFINE_REDUCE(ax_avg_f64, double, a + v, AX_DIVIDE(double))

typedef void (*ax_reduce_fn)(char *, char *, char *const *, int, size_t);

/* op: SUM, PROD, MIN, MAX, and AVG for the float dtypes only (integer AVG
 * floors, which the caller does after a SUM). */
static ax_reduce_fn ax_reducer(int dtype, int op) {
    static const ax_reduce_fn table[5][5] = {
        {ax_sum_f32, ax_prod_f32, ax_min_f32, ax_max_f32, ax_avg_f32},
        {ax_sum_f64, ax_prod_f64, ax_min_f64, ax_max_f64, ax_avg_f64},
        {ax_sum_i32, ax_prod_i32, ax_min_i32, ax_max_i32, NULL},
        {ax_sum_i64, ax_prod_i64, ax_min_i64, ax_max_i64, NULL},
        {ax_sum_u8, ax_prod_u8, ax_min_u8, ax_max_u8, NULL},
    };
    if (dtype < 0 || dtype > 4 || op < 0 || op > 4) return NULL;
    return table[dtype][op];
}

/* Rank k's share [lo, hi) of n elements, cut at multiples of `align` elements. */
static inline void ax_share(size_t n, int k, int p, size_t align, size_t *lo, size_t *hi) {
    size_t units = (n + align - 1) / align;
    size_t a = units * (size_t)k / (size_t)p, b = units * (size_t)(k + 1) / (size_t)p;
    *lo = a * align < n ? a * align : n;
    *hi = b * align < n ? b * align : n;
}

static inline ax_desc *ax_desc_of(ax_shm *s, int rank, uint64_t g) {
    return (ax_desc *)((char *)s->ctrls[rank] + sizeof(ax_ctrl)) + (g % (uint64_t)s->nslots);
}

/* Publish this rank's descriptor of the call that begins at chunk g (before its *copied* store). */
static inline void ax_publish(ax_shm *s, uint64_t g, const int64_t *desc) {
    ax_desc *d = ax_desc_of(s, s->rank, g);
    for (int k = 0; k < AX_DESC_WORDS; k++) d->w[k] = desc[k];
    d->g = g;
}

/* After every rank has copied chunk g: 1 if every rank began the same call at g. */
static inline int ax_agrees(ax_shm *s, uint64_t g, const int64_t *desc) {
    for (int r = 0; r < s->size; r++) {
        if (r == s->rank) continue;
        const ax_desc *d = ax_desc_of(s, r, g);
        if (d->g != g) return 0;
        for (int k = 0; k < AX_DESC_WORDS; k++)
            if (d->w[k] != desc[k]) return 0;
    }
    return 1;
}

/* ax_agrees, blind to the bits `loose` of word 0 (how each rank makes a call that another transport
 * carries); on agreement *seen gets those bits of every rank, ORed. */
static inline int ax_agrees_loosely(ax_shm *s, uint64_t g, const int64_t *desc, int64_t loose, int64_t *seen) {
    int64_t bits = desc[0] & loose;
    for (int r = 0; r < s->size; r++) {
        if (r == s->rank) continue;
        const ax_desc *d = ax_desc_of(s, r, g);
        if (d->g != g || (d->w[0] & ~loose) != (desc[0] & ~loose)) return 0;
        for (int k = 1; k < AX_DESC_WORDS; k++)
            if (d->w[k] != desc[k]) return 0;
        bits |= d->w[0] & loose;
    }
    *seen = bits;
    return 1;
}

static inline char *ax_slot(ax_shm *s, int rank, uint64_t g) {
    return s->segs[rank] + (size_t)(g % (uint64_t)s->nslots) * s->slot_bytes;
}

/* 1 once every rank's counter `field` is at least `target` (ax_wait_all without the wait). */
static inline int ax_ready(ax_shm *s, int field, uint64_t target) {
    for (int r = 0; r < s->size; r++)
        if (ax_load(ax_field(s->ctrls[r], field)) < target) return 0;
    return 1;
}

/* [Note: a call as a state machine]
 * Every collective is an ax_op that ax_step advances as far as it can go
 * without waiting for another rank; where it must wait it returns 0 and says
 * for what (every rank's counter `wait_field` at `wait_target`), and the next
 * ax_step goes on from there. ax_run makes a blocking call of it: step, wait
 * (ax_wait_all: spin, yield, sleep, timeout), step again. A nonblocking call
 * keeps its ax_op and is stepped by whoever waits (_shm.Engine.progress), so
 * one thread can have calls of several engines in flight at once and wait for
 * them in any order. The steps are the protocol's, in its order: a call made
 * blocking on one rank and nonblocking on another meets itself chunk by chunk.
 * The calls of one engine run one after another (the caller queues them): a
 * call takes its chunk numbers from s->seq as it goes. */
enum { AX_OP_ALLREDUCE, AX_OP_REDUCE_SCATTER, AX_OP_BROADCAST, AX_OP_ALLGATHER, AX_OP_ALLREDUCE_DIRECT,
       AX_OP_ALLGATHER_DIRECT, AX_OP_AGREE };
enum { AX_PHASE_DONE = 100, AX_PHASE_REFUSED = 101 };

typedef struct {
    int kind;
    int phase;                 /* the step the current chunk is at (0: the chunk begins) */
    int rc;                    /* once done: 0, -2 (bad dtype, op or geometry) or AX_MISMATCH */
    int checked;               /* every rank's descriptor was found equal (or the call is not compared) */
    char *x;                   /* the data: in place (all-reduce, broadcast), or the input */
    char *out;                 /* reduce-scatter's block, all-gather's p blocks */
    size_t count;              /* elements of x (reduce-scatter: of one block; broadcast, all-gather: bytes) */
    size_t itemsize;
    size_t offset;             /* the direct calls: x's offset in every rank's segment */
    int root;
    ax_reduce_fn reduce;
    const int64_t *desc;       /* NULL: not compared (settings.check_collectives off); else points at w */
    int64_t w[AX_DESC_WORDS];
    int64_t loose, seen;       /* AX_OP_AGREE: the bits of word 0 left out of the comparison, and their OR */
    size_t first;              /* the first element of the current chunk */
    uint64_t g;                /* the current chunk's number */
    int wait_field;            /* what it waits for, when ax_step returns 0 */
    uint64_t wait_target;
} ax_op;

/* Fill `o` for a call; returns 0, or -2 for an operation or geometry the kernels do not take. */
static int ax_op_init(ax_op *o, ax_shm *s, int kind, char *x, char *out, size_t count, int dtype, int op,
                      size_t itemsize, int root, size_t offset, const int64_t *desc) {
    memset(o, 0, sizeof *o);
    o->kind = kind;
    o->x = x;
    o->out = out;
    o->count = count;
    o->itemsize = itemsize;
    o->root = root;
    o->offset = offset;
    if (desc) {
        for (int k = 0; k < AX_DESC_WORDS; k++) o->w[k] = desc[k];
        o->desc = o->w;
    } else {
        o->checked = 1;
    }
    if (kind == AX_OP_ALLREDUCE || kind == AX_OP_REDUCE_SCATTER || kind == AX_OP_ALLREDUCE_DIRECT) {
        o->reduce = ax_reducer(dtype, op);
        if (o->reduce == NULL) return -2;
    }
    if (kind == AX_OP_REDUCE_SCATTER && s->slot_bytes / itemsize / (size_t)s->size == 0) return -2;
    /* nothing to move: one step that only compares (or nothing at all, unchecked) */
    if (count == 0 && kind != AX_OP_ALLREDUCE_DIRECT && kind != AX_OP_ALLGATHER_DIRECT && kind != AX_OP_AGREE) {
        o->kind = AX_OP_AGREE;
        if (!desc) o->phase = AX_PHASE_DONE;
    }
    return 0;
}

#define AX_WAIT_FOR(F, T)                                               \
    do {                                                                \
        if (!ax_ready(s, (F), (T))) {                                   \
            o->wait_field = (F);                                        \
            o->wait_target = (T);                                       \
            return 0;                                                   \
        }                                                               \
    } while (0)
#define AX_FINISH(RC)                                                   \
    do {                                                                \
        o->rc = (RC);                                                   \
        o->phase = AX_PHASE_DONE;                                       \
        return 1;                                                       \
    } while (0)
/* The slot of chunk g may be filled once every rank is done with chunk g - nslots. */
#define AX_WAIT_SLOT()                                                  \
    if (o->g >= (uint64_t)s->nslots) AX_WAIT_FOR(AX_DONE, o->g - (uint64_t)s->nslots + 1)

/* The ranks disagree about the call begun at chunk g: finish the chunk's steps
 * without touching any data, then wait until every rank has (so no descriptor
 * is rewritten while a slower rank still reads it) and end with AX_MISMATCH. */
static int ax_refuse(ax_shm *s, ax_op *o) {
    ax_store(&s->ctrls[s->rank]->reduced, o->g + 1);
    ax_store(&s->ctrls[s->rank]->done, o->g + 1);
    o->phase = AX_PHASE_REFUSED;
    AX_WAIT_FOR(AX_DONE, o->g + 1);
    AX_FINISH(AX_MISMATCH);
}

/* The first chunk of a call: publish before the *copied* store, check after the wait for every rank's. */
#define AX_PUBLISH_FIRST() if (o->first == 0 && o->desc) ax_publish(s, o->g, o->desc)
#define AX_CHECK_FIRST()                                                        \
    if (o->first == 0) {                                                        \
        if (o->desc && !ax_agrees(s, o->g, o->desc)) return ax_refuse(s, o);    \
        o->checked = 1;                                                         \
    }

/* One step that moves no data: every rank publishes its call's descriptor and
 * checks the others' (blind to the bits `loose` of word 0, whose OR over the
 * ranks goes to `seen`). Used for a call that moves nothing, and before a call
 * that another transport (MPI) will carry. */
static int ax_step_agree(ax_shm *s, ax_op *o) {
    switch (o->phase) {
    case 0:
        o->g = s->seq++;
        o->phase = 1;
        /* fallthrough */
    case 1:
        AX_WAIT_SLOT();
        ax_publish(s, o->g, o->desc);
        ax_store(&s->ctrls[s->rank]->copied, o->g + 1);
        o->phase = 2;
        /* fallthrough */
    default:
        AX_WAIT_FOR(AX_COPIED, o->g + 1);
        if (!ax_agrees_loosely(s, o->g, o->desc, o->loose, &o->seen)) return ax_refuse(s, o);
        o->checked = 1;
        ax_store(&s->ctrls[s->rank]->reduced, o->g + 1);
        ax_store(&s->ctrls[s->rank]->done, o->g + 1);
        AX_FINISH(0);
    }
}

/* In-place all-reduce of `count` elements at x. Per chunk: copy in what the
 * other ranks reduce (all but this rank's share, which only it reads, from x),
 * wait for every copy, reduce this rank's share into its own slot and into x
 * at once, wait for every share, copy the other shares out. Compared with
 * copying whole chunks through the slots, each rank moves 3/p of the message
 * less through memory (4 against 5.5 message sizes at 2 ranks); the sum is
 * the same, in rank order. */
static int ax_step_allreduce(ax_shm *s, ax_op *o) {
    const int p = s->size, me = s->rank;
    const size_t isz = o->itemsize, per_chunk = s->slot_bytes / isz, align = 64 / isz; /* shares on cache lines */
    char *srcs[AX_MAX_RANKS];
    size_t lo, hi;
    for (;;) {
        const size_t n = o->count - o->first < per_chunk ? o->count - o->first : per_chunk;
        char *xc = o->x + o->first * isz;
        switch (o->phase) {
        case 0:
            if (o->first >= o->count) AX_FINISH(0);
            o->g = s->seq++;
            o->phase = 1;
            /* fallthrough */
        case 1: {
            AX_WAIT_SLOT();
            char *mine = ax_slot(s, me, o->g);
            ax_share(n, me, p, align, &lo, &hi);
            ax_copy(mine, xc, lo * isz);
            ax_copy(mine + hi * isz, xc + hi * isz, (n - hi) * isz);
            AX_PUBLISH_FIRST();
            ax_store(&s->ctrls[me]->copied, o->g + 1);
            o->phase = 2;
        }
            /* fallthrough */
        case 2:
            AX_WAIT_FOR(AX_COPIED, o->g + 1);
            AX_CHECK_FIRST();
            ax_share(n, me, p, align, &lo, &hi);
            if (hi > lo) {
                for (int r = 0; r < p; r++) srcs[r] = (r == me ? xc : ax_slot(s, r, o->g)) + lo * isz;
                o->reduce(ax_slot(s, me, o->g) + lo * isz, xc + lo * isz, srcs, p, hi - lo);
            }
            ax_store(&s->ctrls[me]->reduced, o->g + 1);
            o->phase = 3;
            /* fallthrough */
        default:
            AX_WAIT_FOR(AX_REDUCED, o->g + 1);
            for (int k = 0; k < p; k++) {
                if (k == me) continue;
                ax_share(n, k, p, align, &lo, &hi);
                if (hi > lo) ax_copy(xc + lo * isz, ax_slot(s, k, o->g) + lo * isz, (hi - lo) * isz);
            }
            ax_store(&s->ctrls[me]->done, o->g + 1);
            o->first += per_chunk;
            o->phase = 0;
        }
    }
}

/* Reduce-scatter: x holds p blocks of `count` elements; out receives the
 * reduction of block `rank`. Per chunk every rank copies the same window of
 * each other rank's block into its slot (p - 1 pieces), and the owner of a
 * block reduces its piece straight into `out`, its own part read from x. */
static int ax_step_reduce_scatter(ax_shm *s, ax_op *o) {
    const int p = s->size, me = s->rank;
    const size_t isz = o->itemsize, piece = s->slot_bytes / isz / (size_t)p, block = o->count;
    char *srcs[AX_MAX_RANKS];
    for (;;) {
        const size_t n = block - o->first < piece ? block - o->first : piece;
        switch (o->phase) {
        case 0:
            if (o->first >= block) AX_FINISH(0);
            o->g = s->seq++;
            o->phase = 1;
            /* fallthrough */
        case 1: {
            AX_WAIT_SLOT();
            char *mine = ax_slot(s, me, o->g);
            for (int k = 0; k < p; k++)
                if (k != me) /* its own piece only this rank reads, from x */
                    ax_copy(mine + (size_t)k * piece * isz, o->x + ((size_t)k * block + o->first) * isz, n * isz);
            AX_PUBLISH_FIRST();
            ax_store(&s->ctrls[me]->copied, o->g + 1);
            o->phase = 2;
        }
            /* fallthrough */
        default:
            AX_WAIT_FOR(AX_COPIED, o->g + 1);
            AX_CHECK_FIRST();
            for (int r = 0; r < p; r++)
                srcs[r] = r == me ? o->x + ((size_t)me * block + o->first) * isz
                                  : ax_slot(s, r, o->g) + (size_t)me * piece * isz;
            o->reduce(o->out + o->first * isz, NULL, srcs, p, n);
            ax_store(&s->ctrls[me]->reduced, o->g + 1);
            ax_store(&s->ctrls[me]->done, o->g + 1);
            o->first += piece;
            o->phase = 0;
        }
    }
}

/* Broadcast of `count` bytes at x from `root`: the root copies each chunk
 * into its slot, the others copy it out. */
static int ax_step_broadcast(ax_shm *s, ax_op *o) {
    const int me = s->rank;
    const size_t per_chunk = s->slot_bytes;
    for (;;) {
        const size_t n = o->count - o->first < per_chunk ? o->count - o->first : per_chunk;
        switch (o->phase) {
        case 0:
            if (o->first >= o->count) AX_FINISH(0);
            o->g = s->seq++;
            o->phase = 1;
            /* fallthrough */
        case 1:
            AX_WAIT_SLOT();
            if (me == o->root) ax_copy(ax_slot(s, me, o->g), o->x + o->first, n);
            AX_PUBLISH_FIRST();
            ax_store(&s->ctrls[me]->copied, o->g + 1);
            /* *reduced* after the check on the first chunk: a refusal must be able to finish the step */
            if (o->first != 0) ax_store(&s->ctrls[me]->reduced, o->g + 1);
            o->phase = 2;
            /* fallthrough */
        default:
            AX_WAIT_FOR(AX_COPIED, o->g + 1);
            if (o->first == 0) {
                AX_CHECK_FIRST();
                ax_store(&s->ctrls[me]->reduced, o->g + 1);
            }
            if (me != o->root) ax_copy(o->x + o->first, ax_slot(s, o->root, o->g), n);
            ax_store(&s->ctrls[me]->done, o->g + 1);
            o->first += per_chunk;
            o->phase = 0;
        }
    }
}

/* All-gather of `count` bytes at x from every rank into out (p blocks of
 * `count`, in rank order): per chunk each rank copies its piece into its
 * slot, and once every piece is there copies all of them out. */
static int ax_step_allgather(ax_shm *s, ax_op *o) {
    const int p = s->size, me = s->rank;
    const size_t per_chunk = s->slot_bytes, nbytes = o->count;
    for (;;) {
        const size_t n = nbytes - o->first < per_chunk ? nbytes - o->first : per_chunk;
        switch (o->phase) {
        case 0:
            if (o->first >= nbytes) AX_FINISH(0);
            o->g = s->seq++;
            o->phase = 1;
            /* fallthrough */
        case 1:
            AX_WAIT_SLOT();
            ax_copy(ax_slot(s, me, o->g), o->x + o->first, n);
            AX_PUBLISH_FIRST();
            ax_store(&s->ctrls[me]->copied, o->g + 1);
            o->phase = 2;
            /* fallthrough */
        default:
            AX_WAIT_FOR(AX_COPIED, o->g + 1);
            AX_CHECK_FIRST();
            ax_store(&s->ctrls[me]->reduced, o->g + 1);
            for (int k = 0; k < p; k++) ax_copy(o->out + (size_t)k * nbytes + o->first, ax_slot(s, k, o->g), n);
            ax_store(&s->ctrls[me]->done, o->g + 1);
            o->first += per_chunk;
            o->phase = 0;
        }
    }
}

/* The direct calls (arrays in the window): one step of the counters per call. Arrive: publish the descriptor
 * and *copied*; after the wait for every rank's, compare. */
static inline void ax_arrive(ax_shm *s, ax_op *o) {
    o->g = s->seq++;
    if (o->desc) ax_publish(s, o->g, o->desc);
    ax_store(&s->ctrls[s->rank]->copied, o->g + 1);
    o->phase = 1;
}
#define AX_CHECK_DIRECT()                                                       \
    if (o->desc && !ax_agrees(s, o->g, o->desc)) return ax_refuse(s, o);       \
    o->checked = 1

/* All-reduce of an array that lives in every rank's segment at the same
 * offset (a buffer allocated in the window: no copy in). Arrive, wait for
 * every rank; reduce this rank's share from all ranks' arrays into its own;
 * wait; copy the other ranks' shares from their arrays; wait until every
 * rank has copied, because the caller may write into the array as soon as
 * the call returns. One call is one step of the counters. */
static int ax_step_allreduce_direct(ax_shm *s, ax_op *o) {
    const int p = s->size, me = s->rank;
    const size_t isz = o->itemsize, align = 64 / isz, off = o->offset;
    char *srcs[AX_MAX_RANKS];
    size_t lo, hi;
    switch (o->phase) {
    case 0:
        ax_arrive(s, o);
        /* fallthrough */
    case 1:
        AX_WAIT_FOR(AX_COPIED, o->g + 1);
        AX_CHECK_DIRECT();
        ax_share(o->count, me, p, align, &lo, &hi);
        if (hi > lo) {
            for (int r = 0; r < p; r++) srcs[r] = s->segs[r] + off + lo * isz;
            o->reduce(s->segs[me] + off + lo * isz, NULL, srcs, p, hi - lo);
        }
        ax_store(&s->ctrls[me]->reduced, o->g + 1);
        o->phase = 2;
        /* fallthrough */
    case 2:
        AX_WAIT_FOR(AX_REDUCED, o->g + 1);
        for (int k = 0; k < p; k++) {
            if (k == me) continue;
            ax_share(o->count, k, p, align, &lo, &hi);
            if (hi > lo) ax_copy(s->segs[me] + off + lo * isz, s->segs[k] + off + lo * isz, (hi - lo) * isz);
        }
        ax_store(&s->ctrls[me]->done, o->g + 1);
        o->phase = 3;
        /* fallthrough */
    default:
        AX_WAIT_FOR(AX_DONE, o->g + 1);
        AX_FINISH(0);
    }
}

/* All-gather of `count` bytes that live in every rank's segment at the same
 * offset, into out (p blocks, rank order), with no copy in: arrive, wait for
 * every rank, copy each rank's part straight from its segment, then wait
 * until every rank has copied (the caller may write into its part as soon
 * as the call returns). One call is one step of the counters. */
static int ax_step_allgather_direct(ax_shm *s, ax_op *o) {
    const int p = s->size, me = s->rank;
    switch (o->phase) {
    case 0:
        ax_arrive(s, o);
        /* fallthrough */
    case 1:
        AX_WAIT_FOR(AX_COPIED, o->g + 1);
        AX_CHECK_DIRECT();
        ax_store(&s->ctrls[me]->reduced, o->g + 1);
        for (int k = 0; k < p; k++) ax_copy(o->out + (size_t)k * o->count, s->segs[k] + o->offset, o->count);
        ax_store(&s->ctrls[me]->done, o->g + 1);
        o->phase = 2;
        /* fallthrough */
    default:
        AX_WAIT_FOR(AX_DONE, o->g + 1);
        AX_FINISH(0);
    }
}

/* Advance `o` as far as it goes without waiting: 1 once done (o->rc says how
 * it ended), 0 where it waits for every rank's counter o->wait_field to reach
 * o->wait_target. */
static int ax_step(ax_shm *s, ax_op *o) {
    if (o->phase == AX_PHASE_DONE) return 1;
    if (o->phase == AX_PHASE_REFUSED) {
        AX_WAIT_FOR(AX_DONE, o->g + 1);
        AX_FINISH(AX_MISMATCH);
    }
    switch (o->kind) {
    case AX_OP_ALLREDUCE: return ax_step_allreduce(s, o);
    case AX_OP_REDUCE_SCATTER: return ax_step_reduce_scatter(s, o);
    case AX_OP_BROADCAST: return ax_step_broadcast(s, o);
    case AX_OP_ALLGATHER: return ax_step_allgather(s, o);
    case AX_OP_ALLREDUCE_DIRECT: return ax_step_allreduce_direct(s, o);
    case AX_OP_ALLGATHER_DIRECT: return ax_step_allgather_direct(s, o);
    default: return ax_step_agree(s, o);
    }
}

/* ax_step, then up to `spins` busy polls of what it waits for, stepping on as
 * soon as that is there: a nonblocking call's wait (_shm.Engine.progress) stays
 * in C for as long as a blocking call's first spins. */
static int ax_step_spinning(ax_shm *s, ax_op *o, long spins) {
    int finished = ax_step(s, o);
    for (long k = 0; !finished && k < spins; k++) {
        if (ax_ready(s, o->wait_field, o->wait_target)) finished = ax_step(s, o);
        else AX_CPU_RELAX();
    }
    return finished;
}

/* A blocking call: step, and wait where it must. Returns o->rc, or -1 once a
 * wait timed out or was abandoned (lagging[r] set for every rank behind). */
static int ax_run(ax_shm *s, ax_op *o, double timeout, unsigned char *lagging) {
    while (!ax_step(s, o))
        if (ax_wait_all(s, o->wait_field, o->wait_target, timeout, lagging)) return -1;
    return o->rc;
}

/* `o` was copied to where it now lies: its descriptor pointer follows it. */
static inline void ax_op_moved(ax_op *o) {
    if (o->desc) o->desc = o->w;
}

/* lagging[r] = 1 for every rank r whose counter keeps `o` waiting (0 for the others). */
static void ax_lagging(ax_shm *s, const ax_op *o, unsigned char *lagging) {
    for (int r = 0; r < s->size; r++)
        lagging[r] = o->phase != AX_PHASE_DONE && ax_load(ax_field(s->ctrls[r], o->wait_field)) < o->wait_target;
}

#endif /* AXONHPC_SHM_ENGINE_H */
