/* The layers' host kernels for one floating type; layer_kernels.h includes this once per type with
 * T (the type), FN(name) (the name with the type's suffix), EXP, TANH and LOG defined.
 *
 * Each kernel computes what the numpy code of its layer computes, operation for operation in the
 * same order and type (see [Note: host kernels] in axonhpc/nn/host_kernels.py): the constants
 * are the same doubles rounded to T, as numpy rounds a Python float against a T array. Where
 * numpy sums a row (softmax, LayerNorm, the loss) the sum here is ax_sum8's order, not numpy's
 * pairwise one; that and EXP/TANH are where results may differ from numpy's, by the ulps that
 * tests/ext/test_host_kernels.py states.
 */

/* ---------------------------------------------------------------- row reductions */

static inline T FN(ax_sum8)(const T *a, int64_t n) {
    T acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[j + k];
    T tail = 0;
    for (; j < n; j++) tail += a[j];
    return (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) + tail;
}

static inline T FN(ax_dot8)(const T *a, const T *b, int64_t n) {
    T acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) acc[k] += a[j + k] * b[j + k];
    T tail = 0;
    for (; j < n; j++) tail += a[j] * b[j];
    return (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) + tail;
}

/* The larger of two values, NaN winning (numpy's max propagates NaN). */
static inline T FN(ax_max2)(T acc, T v) { return ((v > acc) | (v != v)) ? v : acc; }  /* | not ||: no branch */

/* The maximum of n values, NaN winning, eight lanes at a time. Written with GCC's vector types: the compiler does
 * not vectorize a select-based max over partial results by itself. */
static inline T FN(ax_max8)(const T *a, int64_t n) {
    typedef T vec_t __attribute__((vector_size(8 * sizeof(T))));
    typedef ITYPE ivec_t __attribute__((vector_size(8 * sizeof(T))));
    vec_t acc;
    for (int k = 0; k < 8; k++) acc[k] = -INFINITY;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        vec_t v;
        memcpy(&v, a + j, sizeof v);
        ivec_t take = (v > acc) | (v != v);
        acc = (vec_t)(((ivec_t)v & take) | ((ivec_t)acc & ~take));
    }
    T m = -INFINITY;
    for (int k = 0; k < 8; k++) m = FN(ax_max2)(m, acc[k]);
    for (; j < n; j++) m = FN(ax_max2)(m, a[j]);
    return m;
}

/* sum(exp(a - m)) without writing the terms. */
static inline T FN(ax_sum_exp8)(const T *a, T m, int64_t n) {
    T acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int k = 0; k < 8; k++) acc[k] += EXP(a[j + k] - m);
    T tail = 0;
    for (; j < n; j++) tail += EXP(a[j] - m);
    return (((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))) + tail;
}

/* ---------------------------------------------------------------- erf (Cody), as nn.functional.erf runs it
 * (float64's ERF; float32's is ax_erff, host_math.h) */

/* floor(v) for 0 <= v < 2^22 (see AX_ROUND_F in host_math.h). */
static inline T FN(ax_floor_small)(T v) {
    T rounded = (v + ROUND) - ROUND;
    return rounded > v ? rounded - (T)1 : rounded;
}

static inline T FN(ax_erf)(T x) {
    const T thresh = (T)0.46875, four = (T)4.0, xbig = (T)27.0;
    T y = x < 0 ? -x : x;
    T num, den;
    /* |x| <= 0.46875 */
    T z = y > thresh ? thresh : y;
    T zsq = z * z;
    num = (T)1.85777706184603153e-1 * zsq;
    den = zsq;
    num = (num + (T)3.16112374387056560e00) * zsq;
    den = (den + (T)2.36012909523441209e01) * zsq;
    num = (num + (T)1.13864154151050156e02) * zsq;
    den = (den + (T)2.44024637934444173e02) * zsq;
    num = (num + (T)3.77485237685302021e02) * zsq;
    den = (den + (T)1.28261652607737228e03) * zsq;
    T small = z * (num + (T)3.20937758913846947e03) / (den + (T)2.84423683343917062e03);
    /* 0.46875 < |x| <= 4 */
    T w = y < thresh ? thresh : (y > four ? four : y);
    num = (T)2.15311535474403846e-8 * w;
    den = w;
    num = (num + (T)5.64188496988670089e-1) * w;
    den = (den + (T)1.57449261107098347e01) * w;
    num = (num + (T)8.88314979438837594e00) * w;
    den = (den + (T)1.17693950891312499e02) * w;
    num = (num + (T)6.61191906371416295e01) * w;
    den = (den + (T)5.37181101862009858e02) * w;
    num = (num + (T)2.98635138197400131e02) * w;
    den = (den + (T)1.62138957456669019e03) * w;
    num = (num + (T)8.81952221241769090e02) * w;
    den = (den + (T)3.29079923573345963e03) * w;
    num = (num + (T)1.71204761263407058e03) * w;
    den = (den + (T)4.36261909014324716e03) * w;
    num = (num + (T)2.05107837782607147e03) * w;
    den = (den + (T)3.43936767414372164e03) * w;
    T mid = (num + (T)1.23033935479799725e03) / (den + (T)1.23033935480374942e03);
    /* |x| > 4 */
    T v = y < four ? four : (y > xbig ? xbig : y);
    T vsq = (T)1.0 / (v * v);
    num = (T)1.63153871373020978e-2 * vsq;
    den = vsq;
    num = (num + (T)3.05326634961232344e-1) * vsq;
    den = (den + (T)2.56852019228982242e00) * vsq;
    num = (num + (T)3.60344899949804439e-1) * vsq;
    den = (den + (T)1.87295284992346047e00) * vsq;
    num = (num + (T)1.25781726111229246e-1) * vsq;
    den = (den + (T)5.27905102951428412e-1) * vsq;
    num = (num + (T)1.60837851487422766e-2) * vsq;
    den = (den + (T)6.05183413124413191e-2) * vsq;
    T tail = ((T)5.6418958354775628695e-1 - vsq * (num + (T)6.58749161529837803e-4)
              / (den + (T)2.33520497626869185e-3)) / v;
    /* exp(-u^2) as exp(-r^2) exp(-(u - r)(u + r)), r = u rounded down to 1/16 (u is in [0.46875, 27]) */
    T u = y > four ? v : w;
    T r = FN(ax_floor_small)(u * (T)16.0) / (T)16.0;
    T erfc = EXP(-r * r) * EXP(-(u - r) * (u + r)) * (y > four ? tail : mid);
    T result = y <= thresh ? small : (T)1.0 - erfc;
    return COPYSIGN(result, x);
}

/* ---------------------------------------------------------------- activations */

#define AX_SQRT_2_OVER_PI 0.7978845608028654
#define AX_TANH_COEF 0.044715
#define AX_INV_SQRT2 0.7071067811865476
#define AX_INV_SQRT_2PI 0.3989422804014327

static inline void FN(ax_gelu_one)(T xv, int tanh_form, T *y, T *aux) {
    if (tanh_form) {
        T t = TANH((T)AX_SQRT_2_OVER_PI * (xv + (T)AX_TANH_COEF * xv * xv * xv));
        *aux = t;
        *y = (T)0.5 * xv * ((T)1 + t);
    } else {
        T cdf = (T)0.5 * ((T)1 + ERF(xv * (T)AX_INV_SQRT2));
        *aux = cdf;
        *y = xv * cdf;
    }
}

/* GELU over rows x cols: y and aux (the normal cdf, or the tanh of the tanh form) of x = pre (+ bias, then
 * written to x). */
AX_HOT void FN(ax_gelu_forward)(const T *pre, const T *bias, T *x, T *y, T *aux, int64_t rows, int64_t cols,
                                int tanh_form) {
    for (int64_t r = 0; r < rows; r++) {
        const T *pr = pre + r * cols;
        T *xr = x + r * cols, *yr = y + r * cols, *ar = aux + r * cols;
        if (bias) {
            if (tanh_form) {
                for (int64_t j = 0; j < cols; j++) {
                    T xv = pr[j] + bias[j];
                    xr[j] = xv;
                    FN(ax_gelu_one)(xv, 1, yr + j, ar + j);
                }
            } else {
                for (int64_t j = 0; j < cols; j++) {
                    T xv = pr[j] + bias[j];
                    xr[j] = xv;
                    FN(ax_gelu_one)(xv, 0, yr + j, ar + j);
                }
            }
        } else if (tanh_form) {
            for (int64_t j = 0; j < cols; j++) FN(ax_gelu_one)(pr[j], 1, yr + j, ar + j);
        } else {
            for (int64_t j = 0; j < cols; j++) FN(ax_gelu_one)(pr[j], 0, yr + j, ar + j);
        }
    }
}

AX_HOT void FN(ax_gelu_backward)(const T *g, const T *x, const T *aux, T *dx, int64_t n, int tanh_form) {
    if (tanh_form) {
        for (int64_t i = 0; i < n; i++) {
            T xv = x[i], t = aux[i];
            T inner = (T)AX_SQRT_2_OVER_PI * ((T)1 + (T)(3 * AX_TANH_COEF) * xv * xv);
            dx[i] = g[i] * ((T)0.5 * ((T)1 + t) + (T)0.5 * xv * ((T)1 - t * t) * inner);
        }
    } else {
        for (int64_t i = 0; i < n; i++) {
            T xv = x[i];
            T pdf = (T)AX_INV_SQRT_2PI * EXP((T)-0.5 * xv * xv);
            dx[i] = g[i] * (aux[i] + xv * pdf);
        }
    }
}

/* ReLU over rows x cols of x = pre (+ bias), as PyTorch's: y = x < 0 ? +0 : x (a select: -inf * 0 would be NaN,
 * -1 * 0 would be -0; NaN and -0 pass as they are), and the mask !(x <= 0) of where the gradient passes (NaN
 * included, as PyTorch's backward passes it where the output is not <= 0). */
AX_HOT void FN(ax_relu_forward)(const T *pre, const T *bias, T *y, uint8_t *mask, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) {
        const T *pr = pre + r * cols;
        T *yr = y + r * cols;
        uint8_t *mr = mask + r * cols;
        if (bias) {
            for (int64_t j = 0; j < cols; j++) {
                T xv = pr[j] + bias[j];
                mr[j] = !(xv <= (T)0);
                yr[j] = xv < (T)0 ? (T)0 : xv;
            }
        } else {
            for (int64_t j = 0; j < cols; j++) {
                T xv = pr[j];
                mr[j] = !(xv <= (T)0);
                yr[j] = xv < (T)0 ? (T)0 : xv;
            }
        }
    }
}

AX_HOT void FN(ax_tanh_backward)(const T *g, const T *y, T *dx, int64_t n) {
    for (int64_t i = 0; i < n; i++) dx[i] = g[i] * ((T)1 - y[i] * y[i]);
}

/* ---------------------------------------------------------------- attention softmax */

/* In place over rows of n scores: s = s * scale, the future masked (causal: row r is query r % n of a square
 * n x n block), then softmax. */
AX_HOT void FN(ax_softmax_forward)(T *scores, int64_t rows, int64_t n, T scale, int causal) {
    for (int64_t r = 0; r < rows; r++) {
        T *s = scores + r * n;
        int64_t lim = causal ? (r % n) + 1 : n;
        for (int64_t j = 0; j < lim; j++) s[j] = s[j] * scale;
        T m = FN(ax_max8)(s, lim);
        for (int64_t j = 0; j < lim; j++) s[j] = EXP(s[j] - m);
        for (int64_t j = lim; j < n; j++) s[j] = 0;
        T sum = FN(ax_sum8)(s, lim);
        for (int64_t j = 0; j < n; j++) s[j] = s[j] / sum;  /* the future too: 0, or NaN as numpy's when sum is */
    }
}

/* ds = attn * (dattn - sum(dattn * attn)) * scale over rows of n (out may be dattn). */
AX_HOT void FN(ax_softmax_backward)(const T *attn, const T *dattn, T *out, int64_t rows, int64_t n, T scale) {
    for (int64_t r = 0; r < rows; r++) {
        const T *a = attn + r * n, *d = dattn + r * n;
        T *o = out + r * n;
        T dot = FN(ax_dot8)(d, a, n);
        for (int64_t j = 0; j < n; j++) {
            T t = a[j] * (d[j] - dot);
            o[j] = t * scale;
        }
    }
}

/* ---------------------------------------------------------------- LayerNorm over the last axis */

AX_HOT void FN(ax_layernorm_forward)(const T *x, const T *weight, const T *bias, T *y, T *xhat, T *rstd,
                                     int64_t rows, int64_t n, T eps) {
    for (int64_t r = 0; r < rows; r++) {
        const T *xr = x + r * n;
        T *hr = xhat + r * n;
        T mean = FN(ax_sum8)(xr, n) / (T)n;
        for (int64_t j = 0; j < n; j++) hr[j] = xr[j] - mean;
        T var = FN(ax_dot8)(hr, hr, n) / (T)n;
        T rs = (T)1.0 / SQRT(var + eps);
        rstd[r] = rs;
        for (int64_t j = 0; j < n; j++) hr[j] = hr[j] * rs;
        if (weight) {
            T *yr = y + r * n;
            for (int64_t j = 0; j < n; j++) yr[j] = hr[j] * weight[j] + bias[j];
        }
    }
}

/* dx from d loss / d y; with weight, d loss / d bias and d loss / d weight summed over the rows into dbias and
 * dweight (which the caller zeroed). */
AX_HOT void FN(ax_layernorm_backward)(const T *g, const T *xhat, const T *rstd, const T *weight, T *dx, T *dweight,
                                      T *dbias, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        const T *gr = g + r * n, *hr = xhat + r * n;
        T *dr = dx + r * n;
        if (weight) {
            for (int64_t j = 0; j < n; j++) {
                dbias[j] += gr[j];
                dweight[j] += gr[j] * hr[j];
                dr[j] = gr[j] * weight[j];
            }
        } else {
            for (int64_t j = 0; j < n; j++) dr[j] = gr[j];
        }
        T m1 = FN(ax_sum8)(dr, n) / (T)n;
        T m2 = FN(ax_dot8)(dr, hr, n) / (T)n;
        T rs = rstd[r];
        for (int64_t j = 0; j < n; j++) dr[j] = rs * ((dr[j] - m1) - hr[j] * m2);
    }
}

/* ---------------------------------------------------------------- cross-entropy over rows of c classes */

AX_HOT void FN(ax_cross_entropy_forward)(const T *x, const int64_t *targets, T *m, T *ls, T *picked, int64_t rows,
                                         int64_t c) {
    for (int64_t r = 0; r < rows; r++) {
        const T *xr = x + r * c;
        T mr = FN(ax_max8)(xr, c);
        T l = LOG(FN(ax_sum_exp8)(xr, mr, c));
        m[r] = mr;
        ls[r] = l;
        picked[r] = (xr[targets[r]] - mr) - l;
    }
}

AX_HOT void FN(ax_cross_entropy_backward)(const T *x, const T *m, const T *ls, const int64_t *targets, T *grad,
                                          int64_t rows, int64_t c, T factor) {
    for (int64_t r = 0; r < rows; r++) {
        const T *xr = x + r * c;
        T *gr = grad + r * c;
        T mr = m[r], l = ls[r];
        for (int64_t j = 0; j < c; j++) gr[j] = EXP((xr[j] - mr) - l) * factor;
        int64_t t = targets[r];  /* the target's term again, with the one subtracted before the scaling */
        gr[t] = (EXP((xr[t] - mr) - l) - (T)1) * factor;
    }
}

/* ---------------------------------------------------------------- embedding backward */

/* out[index[i]] += rows[i] for i in order (numpy's add.at), rows of width values. */
AX_HOT void FN(ax_scatter_add_rows)(const int64_t *index, const T *rows, T *out, int64_t n, int64_t width) {
    for (int64_t i = 0; i < n; i++) {
        T *o = out + index[i] * width;
        const T *src = rows + i * width;
        for (int64_t j = 0; j < width; j++) o[j] = o[j] + src[j];
    }
}
