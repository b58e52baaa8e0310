// Wan's 3-D RoPE on x [L, heads, d], tokens on an (f, h, w) grid. Angles in f64 as the CPU table.
// One thread per (token, pair); it rotates that pair in every head.

template <typename T>
WL_DEVICE void rope_3d(T* out, const T* x, wl_u64 tokens, int heads, int d, int gh, int gw, int t_offset,
                       int pairs_t, int pairs_h, double theta) {
    const int half = d / 2;
    WL_GRID_STRIDE(i, tokens * (wl_u64)half) {
        const wl_u64 n = i / half;
        const int j = (int)(i % half);
        int axis_j, axis_pairs, pos;
        if (j < pairs_t) {
            axis_j = j; axis_pairs = pairs_t; pos = (int)(n / ((wl_u64)gh * gw)) + t_offset;
        } else if (j < pairs_t + pairs_h) {
            axis_j = j - pairs_t; axis_pairs = pairs_h; pos = (int)((n / gw) % gh);
        } else {
            axis_j = j - pairs_t - pairs_h; axis_pairs = half - pairs_t - pairs_h; pos = (int)(n % gw);
        }
        const double freq = 1.0 / pow(theta, (double)(2 * axis_j) / (double)(2 * axis_pairs));
        const double angle = (double)pos * freq;
        const double c = cos(angle), s = sin(angle);
        for (int h = 0; h < heads; ++h) {
            const wl_u64 at = (n * heads + h) * d + 2 * j;
            const double a = wl_ld(x, at), b = wl_ld(x, at + 1);
            wl_st(out, at, (float)(a * c - b * s));
            wl_st(out, at + 1, (float)(a * s + b * c));
        }
    }
}

#define WL_ROPE(T, tn)                                                                                    \
    WL_KERNEL void rope_3d_##tn(T* out, const T* x, wl_u64 tokens, int heads, int d, int gh, int gw,       \
                                int t_offset, int pairs_t, int pairs_h, double theta) {                   \
        rope_3d(out, x, tokens, heads, d, gh, gw, t_offset, pairs_t, pairs_h, theta);                     \
    }

WL_ROPE(float, f32)
WL_ROPE(wl_bf16, bf16)

// A value as stored in T and read back (what rope_3d reads after rms_norm wrote it).
template <typename T>
WL_DEVICE float wl_as_stored(float v);
template <>
WL_DEVICE float wl_as_stored<float>(float v) {
    return v;
}
template <>
WL_DEVICE float wl_as_stored<wl_bf16>(float v) {
    return __uint_as_float((unsigned int)wl_to_bf16(v) << 16);
}

// rope_3d(rms_norm(x, w)) for one token a block: the sum of squares as norm.cu's rms_norm (same
// loop, same block size, same reduction), the token's cos/sin per pair of a head once in shared
// memory, then each pair normalised, rounded to T as rms_norm stores it, and rotated as rope_3d
// rotates it, so the output is the two kernels' bit for bit with one read and one write of x.
#define WL_ROPE_MAX_HALF 256
template <typename T>
WL_DEVICE void rms_norm_rope(T* out, const T* x, const float* w, wl_u64 cols, float eps, int d, int gh, int gw,
                             int t_offset, int pairs_t, int pairs_h, double theta) {
    __shared__ double scratch[32];
    __shared__ double cs[2 * WL_ROPE_MAX_HALF];
    const wl_u64 n = blockIdx.x;
    const T* xr = x + n * cols;
    double s = 0.0;
    for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x) {
        double v = (double)wl_ld(xr, c);
        s += v * v;
    }
    const float inv = (float)(1.0 / sqrt(wl_block_sum_f64(s, scratch) / (double)cols + (double)eps));
    const int half = d / 2;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        int axis_j, axis_pairs, pos;
        if (j < pairs_t) {
            axis_j = j; axis_pairs = pairs_t; pos = (int)(n / ((wl_u64)gh * gw)) + t_offset;
        } else if (j < pairs_t + pairs_h) {
            axis_j = j - pairs_t; axis_pairs = pairs_h; pos = (int)((n / gw) % gh);
        } else {
            axis_j = j - pairs_t - pairs_h; axis_pairs = half - pairs_t - pairs_h; pos = (int)(n % gw);
        }
        const double freq = 1.0 / pow(theta, (double)(2 * axis_j) / (double)(2 * axis_pairs));
        const double angle = (double)pos * freq;
        cs[2 * j] = cos(angle);
        cs[2 * j + 1] = sin(angle);
    }
    __syncthreads();
    T* o = out + n * cols;
    for (wl_u64 p = threadIdx.x; p < cols / 2; p += blockDim.x) {
        const int j = (int)(p % (wl_u64)half);
        const wl_u64 at = 2 * p;
        const double a = wl_as_stored<T>((wl_ld(xr, at) * inv) * w[at]);
        const double b = wl_as_stored<T>((wl_ld(xr, at + 1) * inv) * w[at + 1]);
        const double c = cs[2 * j], sn = cs[2 * j + 1];
        wl_st(o, at, (float)(a * c - b * sn));
        wl_st(o, at + 1, (float)(a * sn + b * c));
    }
}

#define WL_RMS_ROPE(T, tn)                                                                                   \
    WL_KERNEL void rms_norm_rope_##tn(T* out, const T* x, const float* w, wl_u64 cols, float eps, int d,     \
                                      int gh, int gw, int t_offset, int pairs_t, int pairs_h, double theta) { \
        rms_norm_rope(out, x, w, cols, eps, d, gh, gw, t_offset, pairs_t, pairs_h, theta);                   \
    }

WL_RMS_ROPE(float, f32)
WL_RMS_ROPE(wl_bf16, bf16)
