// Element-wise ops. `T` is the tensor's element type, `P` a per-row parameter's (a `[cols]` row
// broadcast over rows, or one row per row: `pn` is its element count).

template <typename T, typename P>
WL_DEVICE void modulate(T* out, const T* x, const P* shift, const P* scale, wl_u64 n, wl_u64 shift_n, wl_u64 scale_n) {
    WL_GRID_STRIDE(i, n) {
        float v = fmaf(wl_ld(x, i), 1.0f + wl_ld(scale, wl_rem(i, scale_n)), wl_ld(shift, wl_rem(i, shift_n)));
        wl_st(out, i, v);
    }
}

// `y` in its own dtype: a bf16 projection output adds into the f32 residual stream without a
// cast pass.
//
// The residual kernels and `add` run in fours (one 16- or 8-byte access per operand, one remainder
// per parameter per four) when n and every parameter's count are multiples of four, as the DiT's
// are; the same expression per element either way, so the results do not depend on the path. The
// products are explicit fmas: the fused residual + FiLM gives the two kernels' bits only if all
// three round alike, which the compiler's contraction choices would not promise.
template <typename T, typename Y, typename P>
WL_DEVICE void gated_residual(T* out, const T* x, const Y* y, const P* gate, wl_u64 n, wl_u64 gate_n) {
    if (((n | gate_n) & 3) == 0) {
        WL_GRID_STRIDE(q, n / 4) {
            const wl_u64 i = q * 4;
            float xv[4], yv[4], g[4], o[4];
            wl_ld4(xv, x, i), wl_ld4(yv, y, i), wl_ld4(g, gate, wl_rem(i, gate_n));
#pragma unroll
            for (int k = 0; k < 4; ++k) o[k] = fmaf(yv[k], g[k], xv[k]);
            wl_st4(out, i, o);
        }
        return;
    }
    WL_GRID_STRIDE(i, n) { wl_st(out, i, fmaf(wl_ld(y, i), wl_ld(gate, wl_rem(i, gate_n)), wl_ld(x, i))); }
}

// modulate(gated_residual(x, y, gate), shift, scale) in one pass, the sum rounded to T in between
// as the two kernels store it: the self-attention residual and LingBot's camera FiLM after it.
// The camera's shift and scale (`C`, per token: the camera layers' bf16 output) keep their dtype
// apart from the gate's, so neither is cast to match the other.
template <typename T, typename Y, typename P, typename C>
WL_DEVICE void gated_residual_modulate(T* out, const T* x, const Y* y, const P* gate, const C* shift, const C* scale,
                                       wl_u64 n, wl_u64 gate_n, wl_u64 shift_n, wl_u64 scale_n) {
    if (((n | gate_n | shift_n | scale_n) & 3) == 0) {
        WL_GRID_STRIDE(q, n / 4) {
            const wl_u64 i = q * 4;
            float xv[4], yv[4], g[4], sh[4], sc[4], o[4];
            wl_ld4(xv, x, i), wl_ld4(yv, y, i), wl_ld4(g, gate, wl_rem(i, gate_n));
            wl_ld4(sh, shift, wl_rem(i, shift_n)), wl_ld4(sc, scale, wl_rem(i, scale_n));
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const float r = wl_as_stored<T>(fmaf(yv[k], g[k], xv[k]));
                o[k] = fmaf(r, 1.0f + sc[k], sh[k]);
            }
            wl_st4(out, i, o);
        }
        return;
    }
    WL_GRID_STRIDE(i, n) {
        const float r = wl_as_stored<T>(fmaf(wl_ld(y, i), wl_ld(gate, wl_rem(i, gate_n)), wl_ld(x, i)));
        wl_st(out, i, fmaf(r, 1.0f + wl_ld(scale, wl_rem(i, scale_n)), wl_ld(shift, wl_rem(i, shift_n))));
    }
}

// x + (y + bias)·gate, the sum y + bias in f32: gated_residual with the bias of the linear that
// made y, which that linear's GEMM left out (its plain plan runs faster than its bias epilogue;
// pipeline's `Linear::defers_bias`). The DiT's types only: x f32, y bf16, bias and gate f32.
WL_KERNEL void gated_residual_bias_f32_bf16_f32(float* out, const float* x, const wl_bf16* y, const float* bias,
                                                const float* gate, wl_u64 n, wl_u64 bias_n, wl_u64 gate_n) {
    if (((n | bias_n | gate_n) & 3) == 0) {
        WL_GRID_STRIDE(q, n / 4) {
            const wl_u64 i = q * 4;
            float xv[4], yv[4], b[4], g[4], o[4];
            wl_ld4(xv, x, i), wl_ld4(yv, y, i), wl_ld4(b, bias, wl_rem(i, bias_n)), wl_ld4(g, gate, wl_rem(i, gate_n));
#pragma unroll
            for (int k = 0; k < 4; ++k) o[k] = fmaf(yv[k] + b[k], g[k], xv[k]);
            wl_st4(out, i, o);
        }
        return;
    }
    WL_GRID_STRIDE(i, n) {
        const float v = wl_ld(y, i) + bias[wl_rem(i, bias_n)];
        out[i] = fmaf(v, gate[wl_rem(i, gate_n)], x[i]);
    }
}

#define WL_RESIDUAL_MOD(T, Y, P, C, tn, yn, pn, cn)                                                           \
    WL_KERNEL void gated_residual_modulate_##tn##_##yn##_##pn##_##cn(T* out, const T* x, const Y* y,         \
                                                                      const P* gate, const C* shift,         \
                                                                      const C* scale, wl_u64 n,              \
                                                                      wl_u64 gate_n, wl_u64 shift_n,         \
                                                                      wl_u64 scale_n) {                      \
        gated_residual_modulate(out, x, y, gate, shift, scale, n, gate_n, shift_n, scale_n);                  \
    }
#define WL_RESIDUAL(T, Y, P, tn, yn, pn)                                                                  \
    WL_KERNEL void gated_residual_##tn##_##yn##_##pn(T* out, const T* x, const Y* y, const P* gate, wl_u64 n, \
                                                      wl_u64 gate_n) {                                     \
        gated_residual(out, x, y, gate, n, gate_n);                                                       \
    }                                                                                                     \
    WL_RESIDUAL_MOD(T, Y, P, float, tn, yn, pn, f32)                                                      \
    WL_RESIDUAL_MOD(T, Y, P, wl_bf16, tn, yn, pn, bf16)
#define WL_RESIDUAL_Y(T, tn, P, pn)                 \
    WL_RESIDUAL(T, float, P, tn, f32, pn)           \
    WL_RESIDUAL(T, wl_bf16, P, tn, bf16, pn)
WL_RESIDUAL_Y(float, f32, float, f32)
WL_RESIDUAL_Y(float, f32, wl_bf16, bf16)
WL_RESIDUAL_Y(wl_bf16, bf16, float, f32)
WL_RESIDUAL_Y(wl_bf16, bf16, wl_bf16, bf16)

template <typename T, typename P>
WL_DEVICE void add(T* out, const T* a, const P* b, wl_u64 n, wl_u64 b_n) {
    if (((n | b_n) & 3) == 0) {
        WL_GRID_STRIDE(q, n / 4) {
            const wl_u64 i = q * 4;
            float av[4], bv[4], o[4];
            wl_ld4(av, a, i), wl_ld4(bv, b, wl_rem(i, b_n));
#pragma unroll
            for (int k = 0; k < 4; ++k) o[k] = av[k] + bv[k];
            wl_st4(out, i, o);
        }
        return;
    }
    WL_GRID_STRIDE(i, n) { wl_st(out, i, wl_ld(a, i) + wl_ld(b, wl_rem(i, b_n))); }
}

template <typename T, typename P>
WL_DEVICE void mul(T* out, const T* a, const P* b, wl_u64 n, wl_u64 b_n) {
    WL_GRID_STRIDE(i, n) { wl_st(out, i, wl_ld(a, i) * wl_ld(b, wl_rem(i, b_n))); }
}

#define WL_TP(T, P, tn, pn)                                                                          \
    WL_KERNEL void modulate_##tn##_##pn(T* out, const T* x, const P* shift, const P* scale, wl_u64 n,  \
                                        wl_u64 shift_n, wl_u64 scale_n) {                            \
        modulate(out, x, shift, scale, n, shift_n, scale_n);                                         \
    }                                                                                                \
    WL_KERNEL void add_##tn##_##pn(T* out, const T* a, const P* b, wl_u64 n, wl_u64 b_n) { add(out, a, b, n, b_n); } \
    WL_KERNEL void mul_##tn##_##pn(T* out, const T* a, const P* b, wl_u64 n, wl_u64 b_n) { mul(out, a, b, n, b_n); }

WL_TP(float, float, f32, f32)
WL_TP(float, wl_bf16, f32, bf16)
WL_TP(wl_bf16, float, bf16, f32)
WL_TP(wl_bf16, wl_bf16, bf16, bf16)

// add(a, b) over [rows, cols] (rows ≤ 8) with row r stored at o_r: a DiT block's six modulation
// rows in one launch (a copy of each row out of the sum was a launch each). The same
// arithmetic as add, so the same bits.
template <typename T, typename P>
WL_DEVICE void add_rows(T* o0, T* o1, T* o2, T* o3, T* o4, T* o5, T* o6, T* o7, const T* a, const P* b,
                        unsigned int rows, unsigned int cols, wl_u64 b_n) {
    T* const outs[8] = {o0, o1, o2, o3, o4, o5, o6, o7};
    WL_GRID_STRIDE(i, (wl_u64)rows * cols) {
        const unsigned int r = (unsigned int)i / cols, c = (unsigned int)i % cols;
        wl_st(outs[r], c, wl_ld(a, i) + wl_ld(b, wl_rem(i, b_n)));
    }
}

#define WL_ADD_ROWS(T, P, tn, pn)                                                                         \
    WL_KERNEL void add_rows_##tn##_##pn(T* o0, T* o1, T* o2, T* o3, T* o4, T* o5, T* o6, T* o7, const T* a, \
                                        const P* b, unsigned int rows, unsigned int cols, wl_u64 b_n) {  \
        add_rows(o0, o1, o2, o3, o4, o5, o6, o7, a, b, rows, cols, b_n);                                  \
    }
WL_ADD_ROWS(float, float, f32, f32)
WL_ADD_ROWS(float, wl_bf16, f32, bf16)
WL_ADD_ROWS(wl_bf16, float, bf16, f32)
WL_ADD_ROWS(wl_bf16, wl_bf16, bf16, bf16)

// alpha·x + beta·y in f64, rounded once (the sampler's update).
template <typename T>
WL_DEVICE void axpby(T* out, double alpha, const T* x, double beta, const T* y, wl_u64 n) {
    WL_GRID_STRIDE(i, n) { wl_st(out, i, (float)(alpha * (double)wl_ld(x, i) + beta * (double)wl_ld(y, i))); }
}

WL_DEVICE float wl_silu(float x) { return x / (1.0f + expf(-x)); }

template <typename T>
WL_DEVICE void gelu_tanh(T* out, const T* x, wl_u64 n) { WL_GRID_STRIDE(i, n) { wl_st(out, i, wl_gelu_tanh(wl_ld(x, i))); } }
template <typename T>
WL_DEVICE void silu(T* out, const T* x, wl_u64 n) { WL_GRID_STRIDE(i, n) { wl_st(out, i, wl_silu(wl_ld(x, i))); } }

#define WL_T(T, tn)                                                                                 \
    WL_KERNEL void axpby_##tn(T* out, double alpha, const T* x, double beta, const T* y, wl_u64 n) { \
        axpby(out, alpha, x, beta, y, n);                                                           \
    }                                                                                               \
    WL_KERNEL void gelu_tanh_##tn(T* out, const T* x, wl_u64 n) { gelu_tanh(out, x, n); }           \
    WL_KERNEL void silu_##tn(T* out, const T* x, wl_u64 n) { silu(out, x, n); }

WL_T(float, f32)
WL_T(wl_bf16, bf16)

WL_KERNEL void cast_f32_bf16(wl_bf16* out, const float* x, wl_u64 n) { WL_GRID_STRIDE(i, n) { out[i] = wl_to_bf16(x[i]); } }
WL_KERNEL void cast_bf16_f32(float* out, const wl_bf16* x, wl_u64 n) { WL_GRID_STRIDE(i, n) { out[i] = wl_ld(x, i); } }
