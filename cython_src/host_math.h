/* Element-wise math for the host kernels (layer_kernels.h, update_kernels.h).
 *
 * [Note: vectorizable float32 math]
 * glibc's expf and tanhf are calls, and a loop that calls them is not
 * vectorized; the layers' float32 kernels spend most of their time in
 * them. ax_expf and ax_tanhf are written with arithmetic, comparisons and
 * integer bit moves only, so GCC vectorizes the loops that use them (4
 * lanes with SSE2, 8 with the AVX2 clone that AX_HOT adds). ax_expf is
 * Cephes' expf: n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts),
 * a degree-6 polynomial, and 2^n applied as two factors so that results
 * down to the smallest subnormal keep their bits. ax_tanhf is Cephes'
 * tanhf: an odd polynomial below |x| = 0.625, 1 - 2 / (e^(2|x|) + 1)
 * above. Both propagate NaN and give +-inf, 0 and +-1 where the C library
 * does; tests/ext/test_host_kernels.py states their error against numpy in ulp.
 * float64 keeps the C library's exp and tanh (one call per element).
 *
 * No kernel relies on the compiler to reorder floating-point operations:
 * the module is compiled with -ffp-contract=off (no fused multiply-add), so
 * the SSE2 and AVX2 clones compute the same bits, and sums over a row use a
 * fixed shape of eight partial sums (ax_sum8), whatever the vector width.
 */
#ifndef AXONHPC_HOST_MATH_H
#define AXONHPC_HOST_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

/* AX_HOT: an AVX2 clone beside the baseline one, chosen at load time (GCC on x86-64 with glibc's ifunc). */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__)
#define AX_HOT __attribute__((target_clones("avx2", "default")))
#else
#define AX_HOT
#endif

static inline float ax_bits_to_float(int32_t bits) {
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline int32_t ax_float_to_bits(float f) {
    int32_t bits;
    memcpy(&bits, &f, sizeof bits);
    return bits;
}

/* 1.5 * 2^23: v + AX_ROUND_F - AX_ROUND_F is v rounded to an integer (|v| < 2^22), and the sum's low mantissa
 * bits are that integer. A float-to-int conversion would do the same, but GCC does not vectorize a loop that
 * converts a value chosen by a select (it cannot prove the conversion in range). */
#define AX_ROUND_F 12582912.0f
#define AX_ROUND_D 6755399441055744.0

static inline float ax_expf(float x) {
    const float hi = 88.72283935546875f;      /* the largest x whose expf is finite */
    const float lo = -103.97208404541015625f; /* below this expf rounds to 0 */
    float xc = x > hi ? hi : x;
    xc = xc < lo ? lo : xc;
    float big = xc * 1.44269504088896341f + AX_ROUND_F;
    int32_t n = ax_float_to_bits(big) - ax_float_to_bits(AX_ROUND_F);
    float nf = big - AX_ROUND_F;
    float r = xc - nf * 0.693359375f;
    r = r - nf * -2.12194440e-4f;
    float r2 = r * r;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r2 + r + 1.0f;
    int32_t n1 = n >> 1;
    int32_t n2 = n - n1;
    float res = (p * ax_bits_to_float((n1 + 127) << 23)) * ax_bits_to_float((n2 + 127) << 23);
    res = x > hi ? INFINITY : res;
    res = x < lo ? 0.0f : res;
    return (x != x) ? x : res;  /* NaN in, NaN out (its garbage exponent above is discarded) */
}

static inline float ax_tanhf(float x) {
    float ac = fabsf(x);
    float z = ac * ac;
    float small = -5.70498872745e-3f;
    small = small * z + 2.06390887954e-2f;
    small = small * z - 5.37397155531e-2f;
    small = small * z + 1.33314422036e-1f;
    small = small * z - 3.33332819422e-1f;
    small = small * z * ac + ac;
    float e = ax_expf(ac + ac);
    float large = 1.0f - 2.0f / (e + 1.0f);
    float res = ac < 0.625f ? small : large;
    res = copysignf(res, x);
    return (x != x) ? x : res;
}

/* erf for float: t P(t^2) below |x| = 1, and 1 - exp(-t^2) S(1/t) from there to 4 (erf(x) rounds to +-1 beyond),
 * P and S polynomials fitted here (weighted least squares at Chebyshev points, against double erf) for this
 * evaluation order. Absolute error about 1 ulp of 1.0 (what GELU's cdf, 0.5 (1 + erf), keeps), 2-3 ulp relative;
 * a third of the operations of Cody's three rational functions and two exponentials. */
static inline float ax_erff(float x) {
    float t = fabsf(x);
    float z = t * t;
    float p = -5.625399062e-04f;
    p = p * z + 4.916026723e-03f;
    p = p * z - 2.670995519e-02f;
    p = p * z + 1.128013059e-01f;
    p = p * z - 3.761231899e-01f;
    p = p * z + 1.128379107e+00f;
    float small = t * p;
    float tc = t < 1.0f ? 1.0f : (t > 4.0f ? 4.0f : t);
    float w = 1.0f / tc;
    float s = -1.694701239e-02f;
    s = s * w + 1.168981791e-01f;
    s = s * w - 3.475897312e-01f;
    s = s * w + 5.694934130e-01f;
    s = s * w - 5.024152994e-01f;
    s = s * w + 4.987008125e-02f;
    s = s * w + 5.579383373e-01f;
    s = s * w + 3.356019151e-04f;
    float large = t >= 4.0f ? 1.0f : 1.0f - ax_expf(-tc * tc) * s;
    float r = copysignf(t < 1.0f ? small : large, x);
    return (x != x) ? x : r;
}

#endif
