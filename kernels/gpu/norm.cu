// Row norms: one block per row; statistics in f64 like the CPU reference. Gains and biases are f32.

template <typename T>
WL_DEVICE void layer_norm(T* out, const T* x, const float* w, const float* b, wl_u64 cols, float eps) {
    __shared__ double scratch[32];
    const wl_u64 row = blockIdx.x;
    const T* xr = x + row * cols;
    double s = 0.0;
    for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x) s += (double)wl_ld(xr, c);
    const double mean = wl_block_sum_f64(s, scratch) / (double)cols;
    double v = 0.0;
    for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        double d = (double)wl_ld(xr, c) - mean;
        v += d * d;
    }
    const double inv = 1.0 / sqrt(wl_block_sum_f64(v, scratch) / (double)cols + (double)eps);
    for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        float y = (float)(((double)wl_ld(xr, c) - mean) * inv);
        if (w) y *= w[c];
        if (b) y += b[c];
        wl_st(out + row * cols, c, y);
    }
}

template <typename T>
WL_DEVICE void rms_norm(T* out, const T* x, const float* w, wl_u64 cols, float eps) {
    __shared__ double scratch[32];
    const wl_u64 row = blockIdx.x;
    const T* xr = x + row * cols;
    double s = 0.0;
    for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        double v = (double)wl_ld(xr, c);
        s += v * v;
    }
    const float inv = (float)(1.0 / sqrt(wl_block_sum_f64(s, scratch) / (double)cols + (double)eps));
    for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x) wl_st(out + row * cols, c, (wl_ld(xr, c) * inv) * w[c]);
}

#define WL_NORM(T, tn)                                                                                     \
    WL_KERNEL void layer_norm_##tn(T* out, const T* x, const float* w, const float* b, wl_u64 cols, float eps) { \
        layer_norm(out, x, w, b, cols, eps);                                                               \
    }                                                                                                      \
    WL_KERNEL void rms_norm_##tn(T* out, const T* x, const float* w, wl_u64 cols, float eps) {             \
        rms_norm(out, x, w, cols, eps);                                                                    \
    }

WL_NORM(float, f32)
WL_NORM(wl_bf16, bf16)

// LayerNorm (no affine) → x·(1+scale)+shift in one pass over a row, written as O (f32 or bf16):
// the input of every attention and FFN projection. `shift`/`scale` are a [cols] row or one row
// per row (`shift_n`, `scale_n` elements).
template <typename T, typename P>
WL_DEVICE float wl_ln_mod(const T* xr, wl_u64 c, double mean, double inv, const P* shift, const P* scale, wl_u64 at,
                          wl_u64 shift_n, wl_u64 scale_n) {
    const float y = (float)(((double)wl_ld(xr, c) - mean) * inv);
    return y * (1.0f + wl_ld(scale, at % scale_n)) + wl_ld(shift, at % shift_n);
}

template <typename T>
WL_DEVICE void wl_row_stats(const T* xr, wl_u64 cols, float eps, double* mean, double* inv) {
    __shared__ double scratch[32];
    double s = 0.0;
    for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x) s += (double)wl_ld(xr, c);
    const double m = wl_block_sum_f64(s, scratch) / (double)cols;
    double v = 0.0;
    for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        const double d = (double)wl_ld(xr, c) - m;
        v += d * d;
    }
    *mean = m;
    *inv = 1.0 / sqrt(wl_block_sum_f64(v, scratch) / (double)cols + (double)eps);
}

template <typename T, typename P, typename O>
WL_DEVICE void norm_modulate(O* out, const T* x, const P* shift, const P* scale, wl_u64 cols, wl_u64 shift_n,
                             wl_u64 scale_n, float eps) {
    const wl_u64 row = blockIdx.x;
    const T* xr = x + row * cols;
    double mean, inv;
    wl_row_stats(xr, cols, eps, &mean, &inv);
    for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x)
        wl_st(out, row * cols + c, wl_ln_mod(xr, c, mean, inv, shift, scale, row * cols + c, shift_n, scale_n));
}

// The same with fp8 e4m3fn output and one scale per row (amax/448), still one kernel: the row is
// normalised twice (once for its amax, once to encode) rather than staged.
template <typename T, typename P>
WL_DEVICE void norm_modulate_fp8(unsigned char* codes, float* scales, const T* x, const P* shift, const P* scale,
                                 wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) {
    __shared__ float scratch[32];
    const wl_u64 row = blockIdx.x;
    const T* xr = x + row * cols;
    double mean, inv;
    wl_row_stats(xr, cols, eps, &mean, &inv);
    float a = 0.0f;
    for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x)
        a = fmaxf(a, fabsf(wl_ln_mod(xr, c, mean, inv, shift, scale, row * cols + c, shift_n, scale_n)));
    const float s = fmaxf(wl_block_max(a, scratch) / 448.0f, 1e-12f);
    const float r = 1.0f / s;
    for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x)
        codes[row * cols + c] = wl_to_e4m3(wl_ln_mod(xr, c, mean, inv, shift, scale, row * cols + c, shift_n, scale_n) * r);
    if (threadIdx.x == 0) scales[row] = s;
}

#define WL_NORM_MOD(T, tn, P, pn)                                                                           \
    WL_KERNEL void norm_modulate_##tn##_##pn##_f32(float* out, const T* x, const P* shift, const P* scale,  \
                                                   wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) { \
        norm_modulate(out, x, shift, scale, cols, shift_n, scale_n, eps);                                   \
    }                                                                                                       \
    WL_KERNEL void norm_modulate_##tn##_##pn##_bf16(wl_bf16* out, const T* x, const P* shift, const P* scale, \
                                                    wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) { \
        norm_modulate(out, x, shift, scale, cols, shift_n, scale_n, eps);                                   \
    }                                                                                                       \
    WL_KERNEL void norm_modulate_##tn##_##pn##_fp8(unsigned char* codes, float* scales, const T* x, const P* shift, \
                                                   const P* scale, wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, \
                                                   float eps) {                                             \
        norm_modulate_fp8(codes, scales, x, shift, scale, cols, shift_n, scale_n, eps);                     \
    }

WL_NORM_MOD(float, f32, float, f32)
WL_NORM_MOD(float, f32, wl_bf16, bf16)
WL_NORM_MOD(wl_bf16, bf16, float, f32)
WL_NORM_MOD(wl_bf16, bf16, wl_bf16, bf16)
