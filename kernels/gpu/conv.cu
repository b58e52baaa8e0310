// The video VAE's ops on channels-first [C, T, H, W] data: the im2col half of a convolution (the
// GEMM half is cuBLASLt), the per-channel bias, norm and affine, nearest upsampling and clamps.
// Per-channel parameters arrive as f32 (the host casts them: they are a few hundred values).

// Column matrix of one tile: row (c, a, b, e) holds that tap's input for output rows r0 .. r0+nr
// of output frames ot .. ot+nf (frame by frame, positions contiguous); taps in the zero padding
// read 0. Row-major [cin·kt·kh·kw, nf·nr·wo]. One grid row per column row (blockIdx.y), so the
// tap is decoded once per thread and neighbouring threads read neighbouring pixels.
template <typename T>
WL_DEVICE void im2col(T* col, const T* x, int cin, int ti, int hi, int wi, int kt, int kh, int kw, int st, int sh,
                      int sw, int pt, int ph, int pw, int ot, int nf, int r0, int nr, int wo) {
    const int row = blockIdx.y;
    const int e = row % kw, b = (row / kw) % kh, a = (row / (kw * kh)) % kt, c = row / (kw * kh * kt);
    const int per_frame = nr * wo, n = nf * per_frame;
    T* dst = col + (wl_u64)row * n;
    for (int pos = blockIdx.x * blockDim.x + threadIdx.x; pos < n; pos += gridDim.x * blockDim.x) {
        const int f = pos / per_frame, rem = pos - f * per_frame;
        const int oy = rem / wo, ox = rem - oy * wo;
        const int it = (ot + f) * st + a - pt;
        const int iy = (r0 + oy) * sh + b - ph, ix = ox * sw + e - pw;
        float v = 0.0f;
        if (it >= 0 && it < ti && iy >= 0 && iy < hi && ix >= 0 && ix < wi)
            v = wl_ld(x, (((wl_u64)c * ti + it) * hi + iy) * wi + ix);
        wl_st(dst, pos, v);
    }
}

// In place: y[c, i] += bias[c] for `per_channel` values per channel.
template <typename T>
WL_DEVICE void add_channel_bias(T* y, const float* bias, wl_u64 per_channel, wl_u64 n) {
    WL_GRID_STRIDE(i, n) { wl_st(y, i, wl_ld(y, i) + bias[i / per_channel]); }
}

// At each of the n positions: the channel vector over its L2 norm (floored at eps), times sqrt(c)
// and gamma[c]; in f64 like the CPU reference, so both round the same products once.
template <typename T>
WL_DEVICE void channel_rms_norm(T* out, const T* x, const float* gamma, int c, wl_u64 n, float eps) {
    WL_GRID_STRIDE(i, n) {
        double ss = 0.0;
        for (int k = 0; k < c; ++k) {
            const double v = wl_ld(x, (wl_u64)k * n + i);
            ss += v * v;
        }
        const double s = sqrt((double)c) / fmax(sqrt(ss), (double)eps);
        for (int k = 0; k < c; ++k) {
            const wl_u64 at = (wl_u64)k * n + i;
            wl_st(out, at, (float)((double)wl_ld(x, at) * s) * gamma[k]);
        }
    }
}

template <typename T>
WL_DEVICE void channel_affine(T* out, const T* x, const float* mul, const float* add, wl_u64 per_channel, wl_u64 n) {
    WL_GRID_STRIDE(i, n) {
        const wl_u64 c = i / per_channel;
        // Two roundings, as on the CPU (no fused multiply-add).
        wl_st(out, i, __fadd_rn(__fmul_rn(wl_ld(x, i), mul[c]), add[c]));
    }
}

// `outer` planes of h × w, each pixel repeated fh × fw times.
template <typename T>
WL_DEVICE void upsample_nearest_2d(T* out, const T* x, wl_u64 outer, int h, int w, int fh, int fw) {
    const wl_u64 oh = (wl_u64)h * fh, ow = (wl_u64)w * fw;
    WL_GRID_STRIDE(i, outer * oh * ow) {
        const wl_u64 p = i / (oh * ow), r = i % (oh * ow);
        const wl_u64 y = r / ow, xx = r % ow;
        out[i] = x[(p * h + y / fh) * w + xx / fw];
    }
}

// NaN passes through both clamps, as on the CPU.
template <typename T>
WL_DEVICE void clamp(T* out, const T* x, wl_u64 n, float lo, float hi) {
    WL_GRID_STRIDE(i, n) {
        const float v = wl_ld(x, i);
        wl_st(out, i, v != v ? v : fminf(fmaxf(v, lo), hi));
    }
}

template <typename T>
WL_DEVICE void soft_clamp(T* out, const T* x, wl_u64 n, float limit) {
    WL_GRID_STRIDE(i, n) { wl_st(out, i, tanhf(wl_ld(x, i) / limit) * limit); }
}

#define WL_CONV(T, tn)                                                                                      \
    WL_KERNEL void im2col_##tn(T* col, const T* x, int cin, int ti, int hi, int wi, int kt, int kh, int kw,   \
                               int st, int sh, int sw, int pt, int ph, int pw, int ot, int nf, int r0, int nr, \
                               int wo) {                                                                    \
        im2col(col, x, cin, ti, hi, wi, kt, kh, kw, st, sh, sw, pt, ph, pw, ot, nf, r0, nr, wo);             \
    }                                                                                                       \
    WL_KERNEL void add_channel_bias_##tn(T* y, const float* bias, wl_u64 per_channel, wl_u64 n) {           \
        add_channel_bias(y, bias, per_channel, n);                                                          \
    }                                                                                                       \
    WL_KERNEL void channel_rms_norm_##tn(T* out, const T* x, const float* gamma, int c, wl_u64 n, float eps) { \
        channel_rms_norm(out, x, gamma, c, n, eps);                                                         \
    }                                                                                                       \
    WL_KERNEL void channel_affine_##tn(T* out, const T* x, const float* mul, const float* add,              \
                                       wl_u64 per_channel, wl_u64 n) {                                      \
        channel_affine(out, x, mul, add, per_channel, n);                                                   \
    }                                                                                                       \
    WL_KERNEL void upsample_nearest_2d_##tn(T* out, const T* x, wl_u64 outer, int h, int w, int fh, int fw) { \
        upsample_nearest_2d(out, x, outer, h, w, fh, fw);                                                   \
    }                                                                                                       \
    WL_KERNEL void clamp_##tn(T* out, const T* x, wl_u64 n, float lo, float hi) { clamp(out, x, n, lo, hi); } \
    WL_KERNEL void soft_clamp_##tn(T* out, const T* x, wl_u64 n, float limit) { soft_clamp(out, x, n, limit); }

WL_CONV(float, f32)
WL_CONV(wl_bf16, bf16)
