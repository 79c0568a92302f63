/* The optimizers' host updates for one floating type; update_kernels.h includes this once per type with T,
 * FN(name) and SQRT defined. Each is the numpy update of its optimizer (axonhpc/optim) operation for operation,
 * in the same order and type, the scalars rounded to T as numpy rounds them: the same bits (the module is
 * compiled without fused multiply-add). */

/* Adam and AdamW: l2 adds weight_decay * param to the gradient (Adam), decoupled scales the parameter by
 * decay = 1 - lr * weight_decay first (AdamW). The moments are torch's exp_avg.lerp_(g, 1 - beta1) (m + w (g - m)
 * for a weight w below 0.5, else g - (g - m)(1 - w)) and exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2), the
 * step its param.addcdiv_(m, denom, -step_size), each in its order. */
AX_HOT void FN(ax_adam)(T *param, const T *grad, T *exp_avg, T *exp_avg_sq, int64_t n, T weight_decay, T decay,
                        T one_minus_beta1, T beta2, T one_minus_beta2, T sqrt_bias_correction2, T eps, T step_size,
                        int l2, int decoupled) {
    for (int64_t i = 0; i < n; i++) {
        T p = param[i];
        T g = l2 ? grad[i] + weight_decay * p : grad[i];
        if (decoupled) p = p * decay;
        T m = exp_avg[i];
        T d = g - m;
        /* torch's lerp, two-sided: exact at a weight of 1 (beta1 = 0) */
        m = one_minus_beta1 < (T)0.5 ? m + d * one_minus_beta1 : g - d * ((T)1 - one_minus_beta1);
        T v = exp_avg_sq[i] * beta2;
        v = v + (g * one_minus_beta2) * g;
        T denom = SQRT(v) / sqrt_bias_correction2;
        denom = denom + eps;
        T update = m * step_size;
        update = update / denom;
        exp_avg[i] = m;
        exp_avg_sq[i] = v;
        param[i] = p - update;
    }
}

/* SGD: l2 adds weight_decay * param; with momentum the buffer takes the gradient on its first step, else
 * buf = buf * momentum + (one_minus_dampening *) g; nesterov steps along g + momentum * buf. */
AX_HOT void FN(ax_sgd)(T *param, const T *grad, T *buf, int64_t n, T weight_decay, T momentum,
                       T one_minus_dampening, T lr, int l2, int has_momentum, int first, int dampened, int nesterov) {
    for (int64_t i = 0; i < n; i++) {
        T p = param[i];
        T g = l2 ? grad[i] + weight_decay * p : grad[i];
        T d = g;
        if (has_momentum) {
            T b;
            if (first) {
                b = g;
            } else {
                b = buf[i] * momentum;
                b = dampened ? b + one_minus_dampening * g : b + g;
            }
            buf[i] = b;
            d = nesterov ? g + momentum * b : b;
        }
        param[i] = p - lr * d;
    }
}
