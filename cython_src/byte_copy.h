/* A byte copy for the shared-memory engine: memcpy without the slow case of
 * x86's `rep movsb`.
 *
 * [Note: misaligned copies]
 * glibc copies a block of more than x86_rep_movsb_threshold bytes (about 2 KiB
 * with AVX2) up to a cache-size bound with the `rep movsb` instruction. On AMD
 * Zen that instruction slows to a crawl when the destination is a few bytes
 * ahead of the source modulo 64: measured on this project's AMD EPYC VM
 * (glibc 2.36), copying 4 KiB-256 KiB ran at 1.3-2 GB/s when
 * (dst - src) % 64 was 1-31, against 25-45 GB/s for every other distance.
 * numpy's data pointers are only 16-byte aligned, so a user's array against a
 * page-aligned slot hits that case half the time; in the shared-memory
 * all-reduce it made each 256 KiB chunk after the first cost 5x.
 *
 * So a copy whose two addresses are not equal modulo 64 is made in pieces
 * below that threshold, which glibc copies with vector loads and stores at
 * full speed whatever their alignment (25-29 GB/s here, against 29-47 GB/s for
 * an aligned memcpy of the same size). Small copies and aligned ones go to
 * memcpy as they are; so do copies of AX_COPY_WHOLE bytes or more, which
 * glibc makes with a vector loop or non-temporal stores rather than
 * `rep movsb` (1 MiB at any distance: 27 GB/s here).
 *
 * Only the engine copies this way: its copies run between cache-resident
 * slots and the caller's array, where the slow case shows. The gradient packs
 * (_buffers.pxd, _bucket.pyx) stream megabytes from memory, where `rep movsb`
 * is the faster copy at every distance (its stores skip the read for
 * ownership): pieces made `axonhpc bench pack`'s 25 MB cases 1.4-1.7x slower,
 * so they keep memmove.
 */
#ifndef AXONHPC_BYTE_COPY_H
#define AXONHPC_BYTE_COPY_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define AX_COPY_PIECE 2048u            /* under glibc's x86_rep_movsb_threshold (2112 with AVX2) */
#define AX_COPY_WHOLE ((size_t)4 << 20) /* from here on, one memcpy */

static inline int ax_copy_in_pieces(const void *dst, const void *src, size_t n) {
    return n > AX_COPY_PIECE && n < AX_COPY_WHOLE && (((uintptr_t)dst - (uintptr_t)src) & 63u) != 0;
}

/* memcpy(dst, src, n): the two ranges do not overlap. */
static inline void ax_copy(void *dst, const void *src, size_t n) {
    if (!ax_copy_in_pieces(dst, src, n)) {
        memcpy(dst, src, n);
        return;
    }
    char *d = (char *)dst;
    const char *s = (const char *)src;
    for (size_t k = 0; k < n; k += AX_COPY_PIECE)
        memcpy(d + k, s + k, n - k < AX_COPY_PIECE ? n - k : AX_COPY_PIECE);
}

#endif
