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
