/* The host kernels of the layers and optimizers, for float32 (suffix _f32) and float64 (_f64).
 * See host_math.h for the float32 math and layer_kernels_impl.h, update_kernels_impl.h for the kernels. */
#ifndef AXONHPC_HOST_KERNELS_H
#define AXONHPC_HOST_KERNELS_H

#include "host_math.h"

#define T float
#define FN(name) name##_f32
#define EXP ax_expf
#define TANH ax_tanhf
#define LOG logf
#define SQRT sqrtf
#define COPYSIGN copysignf
#define ROUND AX_ROUND_F
#define ERF ax_erff
#define ITYPE int32_t
#include "layer_kernels_impl.h"
#include "update_kernels_impl.h"
#undef T
#undef FN
#undef EXP
#undef TANH
#undef LOG
#undef SQRT
#undef COPYSIGN
#undef ROUND
#undef ERF
#undef ITYPE

#define T double
#define FN(name) name##_f64
#define EXP exp
#define TANH tanh
#define LOG log
#define SQRT sqrt
#define COPYSIGN copysign
#define ROUND AX_ROUND_D
#define ERF ax_erf_f64
#define ITYPE int64_t
#include "layer_kernels_impl.h"
#include "update_kernels_impl.h"
#undef T
#undef FN
#undef EXP
#undef TANH
#undef LOG
#undef SQRT
#undef COPYSIGN
#undef ROUND
#undef ERF
#undef ITYPE

#endif
