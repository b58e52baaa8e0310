// Wan's 3-D RoPE on x [L, heads, d], tokens on an (f, h, w) grid. Angles and their cos/sin in
// f64 as the CPU table, the rotation in f32: the f64 rotation's four conversions a pair, at 16
// an SM a clock on Hopper, were half of the fused kernel's time at 14B, and the output (bf16 in
// the model, f32 in the reference's tolerance) cannot tell them apart. One thread per (token,
// pair); it rotates that pair in every head.

// The pair (a, b) rotated by the angle whose cosine and sine are c and s, the products' rounding
// spelled out (no contraction left to the compiler), so rope_3d and rms_norm_rope agree bit for bit.
WL_DEVICE void wl_rotate(float a, float b, float c, float s, float* r) {
    r[0] = fmaf(a, c, -(b * s));
    r[1] = fmaf(a, s, b * c);
}

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
        const float c = (float)cos(angle), s = (float)sin(angle);
        for (int h = 0; h < heads; ++h) {
            const wl_u64 at = (n * heads + h) * d + 2 * j;
            float r[2];
            wl_rotate(wl_ld(x, at), wl_ld(x, at + 1), c, s, r);
            wl_st(out, at, r[0]);
            wl_st(out, at + 1, r[1]);
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

// The cos/sin of every (axis position, pair) a grid of gt × gh × gw tokens needs, as rope_3d
// computes them: t pairs at positions t_offset .. t_offset + gt − 1, then h pairs at 0 .. gh − 1,
// then w pairs at 0 .. gw − 1, each entry (cos, sin), computed in f64 and rounded to f32 as
// rope_3d rounds them. A few thousand entries for a chunk: made once a chunk (the RopeTable
// keeps them), so that no token waits on f64 pow/cos/sin (in the fused kernel below that
// latency, paid per token a block, was three quarters of its time).
WL_KERNEL void rope_angles(float* cs, int gt, int gh, int gw, int t_offset, int pairs_t, int pairs_h, int half,
                           double theta) {
    const int pairs_w = half - pairs_t - pairs_h;
    const wl_u64 nt = (wl_u64)gt * pairs_t, nh = (wl_u64)gh * pairs_h;
    WL_GRID_STRIDE(e, nt + nh + (wl_u64)gw * pairs_w) {
        int axis_j, axis_pairs, pos;
        if (e < nt) {
            axis_pairs = pairs_t; axis_j = (int)(e % pairs_t); pos = (int)(e / pairs_t) + t_offset;
        } else if (e < nt + nh) {
            axis_pairs = pairs_h; axis_j = (int)((e - nt) % pairs_h); pos = (int)((e - nt) / pairs_h);
        } else {
            axis_pairs = pairs_w; axis_j = (int)((e - nt - nh) % pairs_w); pos = (int)((e - nt - nh) / pairs_w);
        }
        const double freq = 1.0 / pow(theta, (double)(2 * axis_j) / (double)(2 * axis_pairs));
        const double angle = (double)pos * freq;
        cs[2 * e] = (float)cos(angle);
        cs[2 * e + 1] = (float)sin(angle);
    }
}

#define WL_ROPE_SUM_BATCH 8
// The 1×4×4 slab sums of rms_norm_rope's output (vsa.rs's frame_sums, what VSA's key-tile and
// query-tile means are made from), in the same launch: each token's block takes a ticket of its
// slab once its row is stored, and the block that takes the slab's last one adds the slab's rows,
// as stored, in row-major order from 0 (frame_sums' order, so the sums are its bits), reading
// them back from L2. A separate sums launch would read the whole chunk again from DRAM, and a
// VSA call's query means would read q once more. `tickets` (a slab each) start at zero and are
// left at zero.
template <typename T>
WL_DEVICE void rope_slab_sums(float* sums, unsigned int* tickets, const T* out, wl_u64 cols, unsigned int n, int gh,
                              int gw) {
    __shared__ unsigned int last;
    const unsigned int f = n / ((unsigned int)gh * gw), y = n / gw % gh, xx = n % gw;
    const unsigned int nh = (gh + 3) / 4, nw = (gw + 3) / 4, y0 = y / 4 * 4, x0 = xx / 4 * 4;
    const unsigned int slab = (f * nh + y / 4) * nw + xx / 4;
    const unsigned int ny = min(y0 + 4, (unsigned int)gh) - y0, nx = min(x0 + 4, (unsigned int)gw) - x0;
    // Every thread's stores before the ticket, and the ticket before the last block's loads.
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(&tickets[slab], 1u) == ny * nx - 1;
        if (last) tickets[slab] = 0;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    const T* first = out + ((wl_u64)f * gh + y0) * gw * cols + (wl_u64)x0 * cols;
    auto row = [&](unsigned int p) { return first + ((wl_u64)(p / nx) * gw + p % nx) * cols; };
    float* dst = sums + (wl_u64)slab * cols;
    const unsigned int n_rows = ny * nx;
    constexpr int N = WlVec<T>::N;
    if (cols % N == 0) {
        for (unsigned int j = threadIdx.x; j < (unsigned int)(cols / N); j += blockDim.x) {
            float acc[N];
#pragma unroll
            for (int c = 0; c < N; ++c) acc[c] = 0.0f;
            // A batch of rows' loads issued before any add. One at a time, each waiting on L2
            // in turn, the sums added 54-64 µs to the q and k pair at 14B on an H100
            // (2026-12-07), most of it, by the count of round trips, these last blocks' tails.
            for (unsigned int p0 = 0; p0 < n_rows; p0 += WL_ROPE_SUM_BATCH) {
                uint4 raw[WL_ROPE_SUM_BATCH];
#pragma unroll
                for (int b = 0; b < WL_ROPE_SUM_BATCH; ++b)
                    if (p0 + b < n_rows) raw[b] = ((const uint4*)row(p0 + b))[j];
#pragma unroll
                for (int b = 0; b < WL_ROPE_SUM_BATCH; ++b) {
                    if (p0 + b >= n_rows) break;
                    float v[N];
                    wl_unpack16(v, raw[b], (const T*)nullptr);
#pragma unroll
                    for (int c = 0; c < N; ++c) acc[c] += v[c];
                }
            }
#pragma unroll
            for (int c = 0; c < N; c += 4) WlVec<float>::store(dst + c, j * (N / 4), acc + c);
        }
    } else {
        for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x) {
            float acc = 0.0f;
            for (unsigned int p = 0; p < n_rows; ++p) acc += wl_ld(row(p), c);
            dst[c] = acc;
        }
    }
}

// rope_3d(rms_norm(x + bias, w)) for one token a block (`bias` f32 or null: a q or k linear's, left
// out of its GEMM, added in f32 as rms_norm adds it): the sum of squares as norm.cu's rms_norm
// (wl_row_sumsq, same block size), the token's cos/sin per pair of a head from rope_angles' table
// into shared memory, then each pair normalised as rms_norm does it, rounded to T as rms_norm
// stores it, and rotated as rope_3d rotates it, so the output is the two kernels' bit for bit
// with one read and one write of x. Rows of whole 16-byte vectors go by vectors (N/2 pairs
// each); the table is then stored with pair j at (j mod N/2)·(half/(N/2)) + j/(N/2), so that the
// 32 lanes of a warp, N/2 pairs apart, read consecutive entries (in the natural order every
// other lane would hit the same bank).
#define WL_ROPE_MAX_HALF 256
template <typename T, bool SUMS>
WL_DEVICE void rms_norm_rope(T* out, const T* x, const float* bias, const float* w, const float* angles, wl_u64 cols,
                             float eps, int d,
                             int gt, int gh, int gw, int pairs_t, int pairs_h, float* sums, unsigned int* tickets) {
    constexpr int N = WlVec<T>::N, K = N / 2;
    __shared__ double scratch[32];
    __shared__ float cc[WL_ROPE_MAX_HALF], ss[WL_ROPE_MAX_HALF];
    // Index math in 32 bits (a block per token, so n < 2^31; a 64-bit division or remainder is
    // a long software routine, and one per vector bound this kernel, not its memory traffic).
    const unsigned int n = blockIdx.x;
    const T* xr = x + (wl_u64)n * cols;
    const int half = d / 2;
    const bool vec = cols % N == 0 && half % K == 0;
    const int stride = half / K;
    auto slot = [&](int j) { return vec ? (j % K) * stride + j / K : j; };
    // The table reads go out before the reduction waits (whose barriers also publish them).
    const unsigned int nt = (unsigned int)gt * pairs_t, nh = (unsigned int)gh * pairs_h;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        unsigned int e;
        if (j < pairs_t)
            e = (n / ((unsigned int)gh * gw)) * pairs_t + j;
        else if (j < pairs_t + pairs_h)
            e = nt + ((n / gw) % gh) * pairs_h + (j - pairs_t);
        else
            e = nt + nh + (n % gw) * (half - pairs_t - pairs_h) + (j - pairs_t - pairs_h);
        cc[slot(j)] = angles[2 * e];
        ss[slot(j)] = angles[2 * e + 1];
    }
    const float inv = (float)(1.0 / sqrt(wl_row_sumsq(xr, bias, cols, scratch) / (double)cols + (double)eps));
    T* o = out + (wl_u64)n * cols;
    if (vec) {
        const unsigned int nv = (unsigned int)(cols / N);
        for (unsigned int j = threadIdx.x; j < nv; j += blockDim.x) {
            float v[N], g[N], r[N];
            wl_load_biased(v, xr, bias, j);
            wl_ld_f32s<N>(g, w, j);
            // The vector's first pair in its head is j·K mod half, i.e. K·(j mod stride).
            const int first = (int)(j % (unsigned int)stride);
#pragma unroll
            for (int k = 0; k < K; ++k) {
                const float a = wl_as_stored<T>((v[2 * k] * inv) * g[2 * k]);
                const float b = wl_as_stored<T>((v[2 * k + 1] * inv) * g[2 * k + 1]);
                const int at = k * stride + first;
                wl_rotate(a, b, cc[at], ss[at], r + 2 * k);
            }
            WlVec<T>::store(o, j, r);
        }
    } else {
        for (wl_u64 p = threadIdx.x; p < cols / 2; p += blockDim.x) {
            const int j = (int)(p % (wl_u64)half);
            const wl_u64 at = 2 * p;
            const float a = wl_as_stored<T>((wl_ld_biased(xr, bias, at) * inv) * w[at]);
            const float b = wl_as_stored<T>((wl_ld_biased(xr, bias, at + 1) * inv) * w[at + 1]);
            float r[2];
            wl_rotate(a, b, cc[j], ss[j], r);
            wl_st(o, at, r[0]);
            wl_st(o, at + 1, r[1]);
        }
    }
    if constexpr (SUMS) rope_slab_sums(sums, tickets, out, cols, n, gh, gw);
}

// The sums (rope_slab_sums) in a kernel of their own: in the plain one they would cost it
// registers (54 against 32 on sm_90a), so blocks an SM, on every call that needs no sums.
#define WL_RMS_ROPE(T, tn)                                                                                     \
    WL_KERNEL void rms_norm_rope_##tn(T* out, const T* x, const float* bias, const float* w, const float* angles,  \
                                      wl_u64 cols, float eps, int d, int gt, int gh, int gw, int pairs_t,       \
                                      int pairs_h, float* sums, unsigned int* tickets) {                       \
        rms_norm_rope<T, false>(out, x, bias, w, angles, cols, eps, d, gt, gh, gw, pairs_t, pairs_h, sums,       \
                                tickets);                                                                    \
    }                                                                                                          \
    WL_KERNEL void rms_norm_rope_sums_##tn(T* out, const T* x, const float* bias, const float* w,                \
                                           const float* angles, wl_u64 cols, float eps, int d, int gt, int gh,   \
                                           int gw, int pairs_t, int pairs_h, float* sums, unsigned int* tickets) { \
        rms_norm_rope<T, true>(out, x, bias, w, angles, cols, eps, d, gt, gh, gw, pairs_t, pairs_h, sums,        \
                               tickets);                                                                     \
    }

WL_RMS_ROPE(float, f32)
WL_RMS_ROPE(wl_bf16, bf16)
