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
