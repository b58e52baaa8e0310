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

// RMSNorm of a row (plus `bias` where given: a q linear's, left out of its GEMM) with its gain:
// 16-byte vectors where the row is a whole number of them (the sum of squares as rope.cu's
// rms_norm_rope takes it: wl_row_sumsq).
template <typename T>
WL_DEVICE void rms_norm(T* out, const T* x, const float* bias, const float* w, wl_u64 cols, float eps) {
    constexpr int N = WlVec<T>::N;
    __shared__ double scratch[32];
    const wl_u64 row = blockIdx.x;
    const T* xr = x + row * cols;
    const float inv = (float)(1.0 / sqrt(wl_row_sumsq(xr, bias, cols, scratch) / (double)cols + (double)eps));
    T* o = out + row * cols;
    if (cols % N == 0) {
        for (unsigned int j = threadIdx.x; j < (unsigned int)(cols / N); j += blockDim.x) {
            float v[N], g[N];
            wl_load_biased(v, xr, bias, j);
            wl_ld_f32s<N>(g, w, j);
#pragma unroll
            for (int c = 0; c < N; ++c) v[c] = (v[c] * inv) * g[c];
            WlVec<T>::store(o, j, v);
        }
    } else {
        for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x)
            wl_st(o, c, (wl_ld_biased(xr, bias, c) * inv) * w[c]);
    }
}

#define WL_NORM(T, tn)                                                                                     \
    WL_KERNEL void layer_norm_##tn(T* out, const T* x, const float* w, const float* b, wl_u64 cols, float eps) { \
        layer_norm(out, x, w, b, cols, eps);                                                               \
    }                                                                                                      \
    WL_KERNEL void rms_norm_##tn(T* out, const T* x, const float* bias, const float* w, wl_u64 cols, float eps) { \
        rms_norm(out, x, bias, w, cols, eps);                                                              \
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

// Rows of up to WL_ROW_REGS · blockDim columns (5120 at 256 threads: every LingBot width) are read once into
// registers: one pass over memory instead of three (four for fp8). The shift/scale offset is a
// per-row base plus the column (their element counts are multiples of `cols`), not a 64-bit
// modulo per element. Wider rows take the re-reading loop.
#define WL_ROW_REGS 20

template <typename T>
WL_DEVICE bool wl_row_in_regs(const T* xr, wl_u64 cols, float eps, float* v, double* mean, double* inv) {
    if (cols > (wl_u64)WL_ROW_REGS * blockDim.x) return false;  // (so c below fits 32 bits)
    __shared__ double scratch[32];
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < WL_ROW_REGS; ++i) {
        const unsigned int c = threadIdx.x + i * blockDim.x;
        v[i] = c < cols ? wl_ld(xr, c) : 0.0f;
        s += (double)v[i];
    }
    const double m = wl_block_sum_f64(s, scratch) / (double)cols;
    double q = 0.0;
#pragma unroll
    for (int i = 0; i < WL_ROW_REGS; ++i) {
        const unsigned int c = threadIdx.x + i * blockDim.x;
        const double d = (double)v[i] - m;
        if (c < cols) q += d * d;
    }
    *mean = m;
    *inv = 1.0 / sqrt(wl_block_sum_f64(q, scratch) / (double)cols + (double)eps);
    return true;
}

// v[i] ← LayerNorm(v[i])·(1 + scale) + shift for this thread's columns.
template <typename P>
WL_DEVICE void wl_modulate_regs(float* v, wl_u64 cols, double mean, double inv, const P* shift, const P* scale,
                                wl_u64 shift_at, wl_u64 scale_at) {
#pragma unroll
    for (int i = 0; i < WL_ROW_REGS; ++i) {
        const unsigned int c = threadIdx.x + i * blockDim.x;
        if (c < cols) {
            const float y = (float)(((double)v[i] - mean) * inv);
            v[i] = y * (1.0f + wl_ld(scale, scale_at + c)) + wl_ld(shift, shift_at + c);
        }
    }
}

template <typename T, typename P, typename O>
WL_DEVICE void norm_modulate(O* out, const T* x, const P* shift, const P* scale, wl_u64 cols, wl_u64 shift_n,
                             wl_u64 scale_n, float eps) {
    const wl_u64 row = blockIdx.x;
    const T* xr = x + row * cols;
    double mean, inv;
    float v[WL_ROW_REGS];
    if (wl_row_in_regs(xr, cols, eps, v, &mean, &inv)) {
        wl_modulate_regs(v, cols, mean, inv, shift, scale, (row * cols) % shift_n, (row * cols) % scale_n);
#pragma unroll
        for (int i = 0; i < WL_ROW_REGS; ++i) {
            const unsigned int c = threadIdx.x + i * blockDim.x;
            if (c < cols) wl_st(out, row * cols + c, v[i]);
        }
        return;
    }
    wl_row_stats(xr, cols, eps, &mean, &inv);
    for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x)
        wl_st(out, row * cols + c, wl_ln_mod(xr, c, mean, inv, shift, scale, row * cols + c, shift_n, scale_n));
}

// The same with fp8 e4m3fn output and one scale per row (amax/448), still one kernel: a row held
// in registers is normalised once; a wider one is normalised twice (once for its amax, once to
// encode) rather than staged.
template <typename T, typename P>
WL_DEVICE void norm_modulate_fp8(unsigned char* codes, float* scales, const T* x, const P* shift, const P* scale,
                                 wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) {
    __shared__ float scratch[32];
    const wl_u64 row = blockIdx.x;
    const T* xr = x + row * cols;
    double mean, inv;
    float v[WL_ROW_REGS];
    if (wl_row_in_regs(xr, cols, eps, v, &mean, &inv)) {
        wl_modulate_regs(v, cols, mean, inv, shift, scale, (row * cols) % shift_n, (row * cols) % scale_n);
        float a = 0.0f;
#pragma unroll
        for (int i = 0; i < WL_ROW_REGS; ++i)
            if (threadIdx.x + i * blockDim.x < cols) a = fmaxf(a, fabsf(v[i]));
        const float s = fmaxf(wl_block_max(a, scratch) / 448.0f, 1e-12f);
        const float r = 1.0f / s;
#pragma unroll
        for (int i = 0; i < WL_ROW_REGS; ++i) {
            const unsigned int c = threadIdx.x + i * blockDim.x;
            if (c < cols) codes[row * cols + c] = wl_to_e4m3(v[i] * r);
        }
        if (threadIdx.x == 0) scales[row] = s;
        return;
    }
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

// 256 threads a row (the launcher's block); two blocks an SM keep enough loads in flight.
#define WL_NORM_BOUNDS __launch_bounds__(256, 2)
#define WL_NORM_MOD(T, tn, P, pn)                                                                           \
    WL_KERNEL void WL_NORM_BOUNDS norm_modulate_##tn##_##pn##_f32(float* out, const T* x, const P* shift, const P* scale,  \
                                                   wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) { \
        norm_modulate(out, x, shift, scale, cols, shift_n, scale_n, eps);                                   \
    }                                                                                                       \
    WL_KERNEL void WL_NORM_BOUNDS norm_modulate_##tn##_##pn##_bf16(wl_bf16* out, const T* x, const P* shift, const P* scale, \
                                                    wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) { \
        norm_modulate(out, x, shift, scale, cols, shift_n, scale_n, eps);                                   \
    }                                                                                                       \
    WL_KERNEL void WL_NORM_BOUNDS norm_modulate_##tn##_##pn##_fp8(unsigned char* codes, float* scales, const T* x, const P* shift, \
                                                   const P* scale, wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, \
                                                   float eps) {                                             \
        norm_modulate_fp8(codes, scales, x, shift, scale, cols, shift_n, scale_n, eps);                     \
    }

WL_NORM_MOD(float, f32, float, f32)
WL_NORM_MOD(float, f32, wl_bf16, bf16)
WL_NORM_MOD(wl_bf16, bf16, float, f32)
WL_NORM_MOD(wl_bf16, bf16, wl_bf16, bf16)

// The same with rows read as 16-byte vectors (8 bf16 or 4 f32 columns) into registers, 128
// threads a row holding WL_VEC_VALUES columns each (5120): with half the threads of a row block
// and fewer registers, three times as many rows are in flight on an SM, with a fraction of the
// load and store instructions. Needs cols to be a multiple of the vector (so every row is
// 16-byte aligned); statistics and modulation are the same arithmetic as above.
#define WL_VEC_VALUES 40
#define WL_VEC_THREADS 128
// "fast" and the residual kernels also come in a narrow build (`fastn`) holding WL_NARROW_VALUES
// columns a thread (rows up to 2048: lingbot-1.3b's 1536, tiny's 128). The same 128 threads
// take the same vectors, so the arithmetic and its bits are the wide build's; only the register
// arrays shrink, so eight rows are in flight on an SM instead of four or five. A 1536-wide row
// leaves each thread three vectors, too few loads in flight for the memory's latency at four or
// five rows an SM: the 1.3B block's three fast norms took 31–58 µs, 30–50 % of copy bandwidth.
#define WL_NARROW_VALUES 16

// N values as bf16 (one 16- or 8-byte store) or as e4m3 codes after scaling by r (8 or 4 bytes).
template <int N>
WL_DEVICE void wl_st_bf16s(wl_bf16* row, unsigned int j, const float* v);
template <>
WL_DEVICE void wl_st_bf16s<8>(wl_bf16* row, unsigned int j, const float* v) {
    ((uint4*)row)[j] = make_uint4(wl_pack_bf16(v[0], v[1]), wl_pack_bf16(v[2], v[3]), wl_pack_bf16(v[4], v[5]),
                                  wl_pack_bf16(v[6], v[7]));
}
template <>
WL_DEVICE void wl_st_bf16s<4>(wl_bf16* row, unsigned int j, const float* v) {
    ((uint2*)row)[j] = make_uint2(wl_pack_bf16(v[0], v[1]), wl_pack_bf16(v[2], v[3]));
}
WL_DEVICE unsigned int wl_pack_e4m3(const float* v, float r) {
    return (unsigned int)wl_to_e4m3(v[0] * r) | ((unsigned int)wl_to_e4m3(v[1] * r) << 8) |
           ((unsigned int)wl_to_e4m3(v[2] * r) << 16) | ((unsigned int)wl_to_e4m3(v[3] * r) << 24);
}
template <int N>
WL_DEVICE void wl_st_codes(unsigned char* row, unsigned int j, const float* v, float r);
template <>
WL_DEVICE void wl_st_codes<8>(unsigned char* row, unsigned int j, const float* v, float r) {
    ((uint2*)row)[j] = make_uint2(wl_pack_e4m3(v, r), wl_pack_e4m3(v + 4, r));
}
template <>
WL_DEVICE void wl_st_codes<4>(unsigned char* row, unsigned int j, const float* v, float r) {
    ((unsigned int*)row)[j] = wl_pack_e4m3(v, r);
}

// v ← LayerNorm(row)·(1 + scale) + shift, vector i of this thread at v[i·N ..].
template <typename T, typename P>
WL_DEVICE void wl_vec_row(float* v, const T* xr, wl_u64 cols, float eps, const P* shift, const P* scale,
                          wl_u64 shift_at, wl_u64 scale_at) {
    constexpr int N = WlVec<T>::N, NV = WL_VEC_VALUES / N;
    __shared__ double scratch[32];
    const unsigned int nv = (unsigned int)(cols / N);
    double s = 0.0;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const unsigned int j = threadIdx.x + i * blockDim.x;
        if (j < nv) {
            WlVec<T>::load(v + i * N, xr, j);
#pragma unroll
            for (int k = 0; k < N; ++k) s += (double)v[i * N + k];
        }
    }
    const double mean = wl_block_sum_f64(s, scratch) / (double)cols;
    double q = 0.0;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        if (threadIdx.x + i * blockDim.x < nv) {
#pragma unroll
            for (int k = 0; k < N; ++k) {
                const double d = (double)v[i * N + k] - mean;
                q += d * d;
            }
        }
    }
    const double inv = 1.0 / sqrt(wl_block_sum_f64(q, scratch) / (double)cols + (double)eps);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const unsigned int j = threadIdx.x + i * blockDim.x;
        if (j < nv) {
#pragma unroll
            for (int k = 0; k < N; ++k) {
                const wl_u64 c = (wl_u64)j * N + k;
                const float y = (float)(((double)v[i * N + k] - mean) * inv);
                v[i * N + k] = y * (1.0f + wl_ld(scale, scale_at + c)) + wl_ld(shift, shift_at + c);
            }
        }
    }
}

template <typename T, typename P>
WL_DEVICE void norm_modulate_vec(wl_bf16* out, const T* x, const P* shift, const P* scale, wl_u64 cols,
                                 wl_u64 shift_n, wl_u64 scale_n, float eps) {
    constexpr int N = WlVec<T>::N, NV = WL_VEC_VALUES / N;
    const wl_u64 row = blockIdx.x;
    float v[WL_VEC_VALUES];
    wl_vec_row(v, x + row * cols, cols, eps, shift, scale, (row * cols) % shift_n, (row * cols) % scale_n);
    const unsigned int nv = (unsigned int)(cols / N);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const unsigned int j = threadIdx.x + i * blockDim.x;
        if (j < nv) wl_st_bf16s<N>(out + row * cols, j, v + i * N);
    }
}

template <typename T, typename P>
WL_DEVICE void norm_modulate_vec_fp8(unsigned char* codes, float* scales, const T* x, const P* shift, const P* scale,
                                     wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) {
    constexpr int N = WlVec<T>::N, NV = WL_VEC_VALUES / N;
    __shared__ float scratch[32];
    const wl_u64 row = blockIdx.x;
    float v[WL_VEC_VALUES];
    wl_vec_row(v, x + row * cols, cols, eps, shift, scale, (row * cols) % shift_n, (row * cols) % scale_n);
    const unsigned int nv = (unsigned int)(cols / N);
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; ++i)
        if (threadIdx.x + i * blockDim.x < nv)
#pragma unroll
            for (int k = 0; k < N; ++k) a = fmaxf(a, fabsf(v[i * N + k]));
    const float s = fmaxf(wl_block_max(a, scratch) / 448.0f, 1e-12f);
    const float r = 1.0f / s;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const unsigned int j = threadIdx.x + i * blockDim.x;
        if (j < nv) wl_st_codes<N>(codes + row * cols, j, v + i * N, r);
    }
    if (threadIdx.x == 0) scales[row] = s;
}

#define WL_NORM_VEC(T, tn, P, pn)                                                                           \
    WL_KERNEL void WL_BOUNDS(WL_VEC_THREADS, 6)                                                             \
        norm_modulate_vec_##tn##_##pn##_bf16(wl_bf16* out, const T* x, const P* shift, const P* scale,      \
                                             wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) {      \
        norm_modulate_vec(out, x, shift, scale, cols, shift_n, scale_n, eps);                               \
    }                                                                                                       \
    WL_KERNEL void WL_BOUNDS(WL_VEC_THREADS, 6)                                                             \
        norm_modulate_vec_##tn##_##pn##_fp8(unsigned char* codes, float* scales, const T* x, const P* shift, \
                                            const P* scale, wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n,    \
                                            float eps) {                                                    \
        norm_modulate_vec_fp8(codes, scales, x, shift, scale, cols, shift_n, scale_n, eps);                 \
    }

WL_NORM_VEC(float, f32, float, f32)
WL_NORM_VEC(float, f32, wl_bf16, bf16)
WL_NORM_VEC(wl_bf16, bf16, float, f32)
WL_NORM_VEC(wl_bf16, bf16, wl_bf16, bf16)

// ---- "lean": the vec kernel's layout (128 threads a row, 16-byte loads, the row in registers)
// with far less arithmetic per element. The vec kernel tops out near 65% of copy bandwidth
// because it is bound by instructions, not memory: four f32↔f64 conversions an element (16 a
// clock on an SM on sm_90, an eighth of the f32 rate), two passes of statistics with a two-barrier
// block reduction each, shift/scale read by scalar loads (a 64-bit offset each, four times the L1
// wavefronts of a 16-byte load) and, for fp8, an encoder with two float→int conversions and a
// branch an element. Here:
// - statistics in one pass: Σ(x−k) and Σ(x−k)² in f64 about the row's first element k, one f64
//   conversion an element and one reduction. With k one of the row's values, (mean−k)² ≤
//   (cols−1)·var, so the cancellation in var = Σ(x−k)²/n − (mean−k)² costs at most log2(cols)
//   of f64's 29 spare bits: var stays far inside f32 rounding of the two-pass value;
// - (x − mean)·inv in f32 with mean and inv as f32 pairs and x − mean_hi exact (TwoSum): every
//   rounding but the last is ~2^-24 below the result, so y is the f32 rounding of the f64
//   expression unless that lies within ~2^-46 of a rounding midpoint (about one element in
//   2^22, and far fewer of the bf16 or e4m3 roundings after it);
// - shift/scale as 16-byte (or 8-byte) vectors (a [cols] shift/scale stays in L1 for all rows);
// - the fp8 encoder without branches or conversions (wl_e4m3_lean, the same codes).

// N shift/scale values (f32 or bf16) of vector j of a row, as f32.
template <typename P, int N>
WL_DEVICE void wl_ld_params(float* v, const P* row, unsigned int j);
template <>
WL_DEVICE void wl_ld_params<float, 4>(float* v, const float* row, unsigned int j) {
    WlVec<float>::load(v, row, j);
}
template <>
WL_DEVICE void wl_ld_params<float, 8>(float* v, const float* row, unsigned int j) {
    WlVec<float>::load(v, row, 2 * j);
    WlVec<float>::load(v + 4, row, 2 * j + 1);
}
template <>
WL_DEVICE void wl_ld_params<wl_bf16, 8>(float* v, const wl_bf16* row, unsigned int j) {
    WlVec<wl_bf16>::load(v, row, j);
}
template <>
WL_DEVICE void wl_ld_params<wl_bf16, 4>(float* v, const wl_bf16* row, unsigned int j) {
    const uint2 r = ((const uint2*)row)[j];
    v[0] = __uint_as_float(r.x << 16);
    v[1] = __uint_as_float(r.x & 0xffff0000u);
    v[2] = __uint_as_float(r.y << 16);
    v[3] = __uint_as_float(r.y & 0xffff0000u);
}

// Block reductions that run once per block, each into its own scratch: one barrier, not
// wl_block_reduce's two (those guard a scratch reused by the next reduction). The same order of
// additions as wl_block_reduce.
WL_DEVICE void wl_block_sum2_f64(double* a, double* b, double* sa, double* sb) {
    for (int m = WL_WARP_SIZE / 2; m > 0; m >>= 1) {
        *a += wl_shfl_xor(*a, m);
        *b += wl_shfl_xor(*b, m);
    }
    const int warp = threadIdx.x / WL_WARP_SIZE, lane = threadIdx.x % WL_WARP_SIZE;
    if (lane == 0) {
        sa[warp] = *a;
        sb[warp] = *b;
    }
    __syncthreads();
    double ta = sa[0], tb = sb[0];
#pragma unroll
    for (int w = 1; w < WL_VEC_THREADS / WL_WARP_SIZE; ++w) {
        ta += sa[w];
        tb += sb[w];
    }
    *a = ta;
    *b = tb;
}
WL_DEVICE float wl_block_max_once(float a, float* s) {
    for (int m = WL_WARP_SIZE / 2; m > 0; m >>= 1) a = fmaxf(a, wl_shfl_xor(a, m));
    if (threadIdx.x % WL_WARP_SIZE == 0) s[threadIdx.x / WL_WARP_SIZE] = a;
    __syncthreads();
    float t = s[0];
#pragma unroll
    for (int w = 1; w < WL_VEC_THREADS / WL_WARP_SIZE; ++w) t = fmaxf(t, s[w]);
    return t;
}

// (v − (mh + ml))·(ih + il): v − mh as s + e exactly (TwoSum: additions only, so no contraction
// can change it), then one rounding of s·ih plus the small terms.
WL_DEVICE float wl_norm_lean(float v, float mh, float ml, float ih, float il) {
    const float s = v - mh;
    const float bb = s - v;
    const float e = (v - (s - bb)) + (-mh - bb);
    return fmaf(s, ih, fmaf(s, il, (e - ml) * ih));
}

// v ← LayerNorm(row)·(1 + scale) + shift, vector i of this thread at v[i·N ..]; `sh`/`sc` point
// at this row's shift/scale.
template <typename T, typename P>
WL_DEVICE void wl_lean_row(float* v, const T* xr, wl_u64 cols, float eps, const P* sh, const P* sc) {
    constexpr int N = WlVec<T>::N, NV = WL_VEC_VALUES / N;
    __shared__ double scratch[2][WL_VEC_THREADS / WL_WARP_SIZE];
    const unsigned int nv = (unsigned int)(cols / N);
    const double k = (double)wl_ld(xr, 0);
    double s1 = 0.0, s2 = 0.0;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const unsigned int j = threadIdx.x + i * WL_VEC_THREADS;
        if (j < nv) {
            WlVec<T>::load(v + i * N, xr, j);
#pragma unroll
            for (int c = 0; c < N; ++c) {
                const double d = (double)v[i * N + c] - k;
                s1 += d;
                s2 = fma(d, d, s2);
            }
        }
    }
    wl_block_sum2_f64(&s1, &s2, scratch[0], scratch[1]);
    const double n = (double)cols, m1 = s1 / n, mean = k + m1;
    const double inv = 1.0 / sqrt(fmax(s2 / n - m1 * m1, 0.0) + (double)eps);
    const float mh = (float)mean, ml = (float)(mean - (double)mh);
    const float ih = (float)inv, il = (float)(inv - (double)ih);
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const unsigned int j = threadIdx.x + i * WL_VEC_THREADS;
        if (j < nv) {
            float a[N], b[N];
            wl_ld_params<P, N>(a, sc, j);
            wl_ld_params<P, N>(b, sh, j);
#pragma unroll
            for (int c = 0; c < N; ++c)
                v[i * N + c] = wl_norm_lean(v[i * N + c], mh, ml, ih, il) * (1.0f + a[c]) + b[c];
        }
    }
}

// On CUDA one cvt.rn.bf16x2 a pair instead of ~7 integer operations an element. Its bits are
// wl_pack_bf16's for every value but NaN (round to nearest even either way), and the values here
// come out of f32 arithmetic, whose NaNs NVIDIA hardware makes the canonical 0x7fffffff: 0x7fff
// from both.
WL_DEVICE unsigned int wl_pack_bf16_lean(float lo, float hi) {
#if defined(WL_CUDA)
    return wl_cvt_bf16x2(lo, hi);
#else
    return wl_pack_bf16(lo, hi);
#endif
}

template <typename T, typename P>
WL_DEVICE void norm_modulate_lean(wl_bf16* out, const T* x, const P* shift, const P* scale, wl_u64 cols,
                                  wl_u64 shift_n, wl_u64 scale_n, float eps) {
    constexpr int N = WlVec<T>::N, NV = WL_VEC_VALUES / N;
    const wl_u64 row = blockIdx.x;
    float v[WL_VEC_VALUES];
    wl_lean_row(v, x + row * cols, cols, eps, shift + (row * cols) % shift_n, scale + (row * cols) % scale_n);
    const unsigned int nv = (unsigned int)(cols / N);
    wl_bf16* o = out + row * cols;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const unsigned int j = threadIdx.x + i * WL_VEC_THREADS;
        if (j < nv) {
            const float* w = v + i * N;
            if constexpr (N == 8)
                ((uint4*)o)[j] = make_uint4(wl_pack_bf16_lean(w[0], w[1]), wl_pack_bf16_lean(w[2], w[3]),
                                            wl_pack_bf16_lean(w[4], w[5]), wl_pack_bf16_lean(w[6], w[7]));
            else
                ((uint2*)o)[j] = make_uint2(wl_pack_bf16_lean(w[0], w[1]), wl_pack_bf16_lean(w[2], w[3]));
        }
    }
}

template <typename T, typename P>
WL_DEVICE void norm_modulate_lean_fp8(unsigned char* codes, float* scales, const T* x, const P* shift,
                                      const P* scale, wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) {
    constexpr int N = WlVec<T>::N, NV = WL_VEC_VALUES / N;
    __shared__ float scratch[WL_VEC_THREADS / WL_WARP_SIZE];
    const wl_u64 row = blockIdx.x;
    float v[WL_VEC_VALUES];
    wl_lean_row(v, x + row * cols, cols, eps, shift + (row * cols) % shift_n, scale + (row * cols) % scale_n);
    const unsigned int nv = (unsigned int)(cols / N);
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; ++i)
        if (threadIdx.x + i * WL_VEC_THREADS < nv)
#pragma unroll
            for (int c = 0; c < N; ++c) a = fmaxf(a, fabsf(v[i * N + c]));
    const float s = fmaxf(wl_block_max_once(a, scratch) / 448.0f, 1e-12f);
    const float r = 1.0f / s;
    unsigned char* cr = codes + row * cols;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const unsigned int j = threadIdx.x + i * WL_VEC_THREADS;
        if (j < nv) {
            if constexpr (N == 8)
                ((uint2*)cr)[j] = make_uint2(wl_pack_e4m3_lean(v + i * N, r), wl_pack_e4m3_lean(v + i * N + 4, r));
            else
                ((unsigned int*)cr)[j] = wl_pack_e4m3_lean(v + i * N, r);
        }
    }
    if (threadIdx.x == 0) scales[row] = s;
}

// ≤ 80 registers (77-80 on sm_90a, no spills): six 128-thread rows an SM, up to 120 KB of loads in
// flight, which is what keeps HBM busy while other rows reduce and compute.
#define WL_NORM_LEAN(T, tn, P, pn)                                                                          \
    WL_KERNEL void WL_BOUNDS(WL_VEC_THREADS, 6)                                                             \
        norm_modulate_lean_##tn##_##pn##_bf16(wl_bf16* out, const T* x, const P* shift, const P* scale,     \
                                              wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) {     \
        norm_modulate_lean(out, x, shift, scale, cols, shift_n, scale_n, eps);                              \
    }                                                                                                       \
    WL_KERNEL void WL_BOUNDS(WL_VEC_THREADS, 6)                                                             \
        norm_modulate_lean_##tn##_##pn##_fp8(unsigned char* codes, float* scales, const T* x, const P* shift, \
                                             const P* scale, wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n,   \
                                             float eps) {                                                   \
        norm_modulate_lean_fp8(codes, scales, x, shift, scale, cols, shift_n, scale_n, eps);                \
    }

WL_NORM_LEAN(float, f32, float, f32)
WL_NORM_LEAN(float, f32, wl_bf16, bf16)
WL_NORM_LEAN(wl_bf16, bf16, float, f32)
WL_NORM_LEAN(wl_bf16, bf16, wl_bf16, bf16)

// ---- "fast": lean's layout and shapes with about half its work an element, for the outputs the
// GEMMs take (bf16, fp8), where lean's f32-exact normalisation is rounded away. Lean spends most
// of its issue slots on the statistics (an f32→f64 conversion, which sm_90 runs at an eighth of
// the f32 rate, and two f64 operations an element) and on the error-free normalisation (nine
// operations an element); with the row in registers, the kernel is bound by those instructions
// as much as by memory (fp8 out at 73% of copy bandwidth). Here:
// - statistics: a thread's own values' mean t (f32), then a = Σ(v−t) and q = Σ(v−t)² in f32,
//   three operations an element. Its sums about the row's first value k follow in f64 from
//   those, per thread: Σ(v−k) = n(t−k) + a and Σ(v−k)² = q + 2(t−k)a + n(t−k)², and the block
//   reduction is lean's. a and q carry f32 rounding relative to the thread's spread about its
//   own mean, so the variance is within a few f32 ulps of the two-pass value;
// - y = (v − mean_hi)·inv + (−mean_lo·inv): one subtraction and one fma (within ~1.5 f32 ulps
//   of lean's y, far below bf16's or e4m3's rounding).
// FULL: every thread holds all WL_VEC_VALUES of its columns (a 5120-wide f32 or bf16 row, the
// 14B model's), so no vector is predicated; the compiler then keeps fewer registers live.
// `load(v, j)` puts the row's vector j (N values) at v, `k` is the row's first value; `keep(v, j)`
// then sees each vector as loaded, after every load of the row is issued. A caller that stores
// what it loaded (the residual stream) stores it there: a store between the loads keeps the
// compiler from issuing the next loads before it (the pointers may alias), and the row's loads
// then wait on each other.
template <int N, typename P, bool FULL, int V, typename Load, typename Keep>
WL_DEVICE void wl_fast_row_by(float* v, Load load, Keep keep, double k, wl_u64 cols, float eps, const P* sh,
                              const P* sc) {
    constexpr int NV = V / N;
    __shared__ double scratch[2][WL_VEC_THREADS / WL_WARP_SIZE];
    const unsigned int nv = (unsigned int)(cols / N);
    auto here = [&](int i) { return FULL || threadIdx.x + i * WL_VEC_THREADS < nv; };
    float s = 0.0f;
    int cnt = 0;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        if (here(i)) {
            load(v + i * N, threadIdx.x + i * WL_VEC_THREADS);
            cnt += N;
#pragma unroll
            for (int c = 0; c < N; ++c) s += v[i * N + c];
        }
    }
#pragma unroll
    for (int i = 0; i < NV; ++i)
        if (here(i)) keep(v + i * N, threadIdx.x + i * WL_VEC_THREADS);
    const float t = cnt > 0 ? s / (float)cnt : 0.0f;
    float a = 0.0f, q = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; ++i)
        if (here(i))
#pragma unroll
            for (int c = 0; c < N; ++c) {
                const float d = v[i * N + c] - t;
                a += d;
                q = fmaf(d, d, q);
            }
    const double dt = (double)t - k, n = (double)cnt;
    double s1 = fma(n, dt, (double)a);
    double s2 = fma(n * dt, dt, fma(2.0 * dt, (double)a, (double)q));
    wl_block_sum2_f64(&s1, &s2, scratch[0], scratch[1]);
    const double nc = (double)cols, m1 = s1 / nc, mean = k + m1;
    const double inv = 1.0 / sqrt(fmax(s2 / nc - m1 * m1, 0.0) + (double)eps);
    const float mh = (float)mean, ih = (float)inv;
    const float c0 = -(float)(mean - (double)mh) * ih;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        if (here(i)) {
            const unsigned int j = threadIdx.x + i * WL_VEC_THREADS;
            float g[N], b[N];
            wl_ld_params<P, N>(g, sc, j);
            wl_ld_params<P, N>(b, sh, j);
#pragma unroll
            for (int c = 0; c < N; ++c)
                v[i * N + c] = fmaf(fmaf(v[i * N + c] - mh, ih, c0), 1.0f + g[c], b[c]);
        }
    }
}

template <typename T, typename P, bool FULL, int V>
WL_DEVICE void wl_fast_row(float* v, const T* xr, wl_u64 cols, float eps, const P* sh, const P* sc) {
    auto load = [&](float* d, unsigned int j) { WlVec<T>::load(d, xr, j); };
    auto keep = [](const float*, unsigned int) {};
    wl_fast_row_by<WlVec<T>::N, P, FULL, V>(v, load, keep, (double)wl_ld(xr, 0), cols, eps, sh, sc);
}

// A normalised row held as wl_fast_row leaves it, stored as bf16, or as e4m3 codes with the
// row's scale (amax/448).
template <int N, bool FULL, int V>
WL_DEVICE void wl_fast_put_bf16(wl_bf16* o, const float* v, unsigned int nv) {
    constexpr int NV = V / N;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const unsigned int j = threadIdx.x + i * WL_VEC_THREADS;
        if (FULL || j < nv) {
            const float* w = v + i * N;
            if constexpr (N == 8)
                ((uint4*)o)[j] = make_uint4(wl_pack_bf16_lean(w[0], w[1]), wl_pack_bf16_lean(w[2], w[3]),
                                            wl_pack_bf16_lean(w[4], w[5]), wl_pack_bf16_lean(w[6], w[7]));
            else
                ((uint2*)o)[j] = make_uint2(wl_pack_bf16_lean(w[0], w[1]), wl_pack_bf16_lean(w[2], w[3]));
        }
    }
}
template <int N, bool FULL, int V>
WL_DEVICE void wl_fast_put_fp8(unsigned char* cr, float* scale_out, const float* v, unsigned int nv) {
    constexpr int NV = V / N;
    __shared__ float scratch[WL_VEC_THREADS / WL_WARP_SIZE];
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < NV; ++i)
        if (FULL || threadIdx.x + i * WL_VEC_THREADS < nv)
#pragma unroll
            for (int c = 0; c < N; ++c) a = fmaxf(a, fabsf(v[i * N + c]));
    const float s = fmaxf(wl_block_max_once(a, scratch) / 448.0f, 1e-12f);
    const float r = 1.0f / s;
#pragma unroll
    for (int i = 0; i < NV; ++i) {
        const unsigned int j = threadIdx.x + i * WL_VEC_THREADS;
        if (FULL || j < nv) {
            if constexpr (N == 8)
                ((uint2*)cr)[j] = make_uint2(wl_pack_e4m3_lean(v + i * N, r), wl_pack_e4m3_lean(v + i * N + 4, r));
            else
                ((unsigned int*)cr)[j] = wl_pack_e4m3_lean(v + i * N, r);
        }
    }
    if (threadIdx.x == 0) *scale_out = s;
}

template <typename T, typename P, bool FULL, int V>
WL_DEVICE void norm_modulate_fast_rows(wl_bf16* out, const T* x, const P* shift, const P* scale, wl_u64 cols,
                                       wl_u64 shift_n, wl_u64 scale_n, float eps) {
    constexpr int N = WlVec<T>::N;
    const wl_u64 row = blockIdx.x;
    float v[V];
    wl_fast_row<T, P, FULL, V>(v, x + row * cols, cols, eps, shift + (row * cols) % shift_n,
                               scale + (row * cols) % scale_n);
    wl_fast_put_bf16<N, FULL, V>(out + row * cols, v, (unsigned int)(cols / N));
}

template <typename T, typename P, bool FULL, int V>
WL_DEVICE void norm_modulate_fast_rows_fp8(unsigned char* codes, float* scales, const T* x, const P* shift,
                                           const P* scale, wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n,
                                           float eps) {
    constexpr int N = WlVec<T>::N;
    const wl_u64 row = blockIdx.x;
    float v[V];
    wl_fast_row<T, P, FULL, V>(v, x + row * cols, cols, eps, shift + (row * cols) % shift_n,
                               scale + (row * cols) % scale_n);
    wl_fast_put_fp8<N, FULL, V>(codes + row * cols, scales + row, v, (unsigned int)(cols / N));
}

// The whole-row case as its own code path (the branch is uniform over the grid); the wide build's
// only: no model row is the narrow build's 2048.
template <typename T, typename P, int V>
WL_DEVICE void norm_modulate_fast(wl_bf16* out, const T* x, const P* shift, const P* scale, wl_u64 cols,
                                  wl_u64 shift_n, wl_u64 scale_n, float eps) {
    if constexpr (V == WL_VEC_VALUES) {
        if (cols == (wl_u64)V * WL_VEC_THREADS) {
            norm_modulate_fast_rows<T, P, true, V>(out, x, shift, scale, cols, shift_n, scale_n, eps);
            return;
        }
    }
    norm_modulate_fast_rows<T, P, false, V>(out, x, shift, scale, cols, shift_n, scale_n, eps);
}
template <typename T, typename P, int V>
WL_DEVICE void norm_modulate_fast_fp8(unsigned char* codes, float* scales, const T* x, const P* shift,
                                      const P* scale, wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) {
    if constexpr (V == WL_VEC_VALUES) {
        if (cols == (wl_u64)V * WL_VEC_THREADS) {
            norm_modulate_fast_rows_fp8<T, P, true, V>(codes, scales, x, shift, scale, cols, shift_n, scale_n, eps);
            return;
        }
    }
    norm_modulate_fast_rows_fp8<T, P, false, V>(codes, scales, x, shift, scale, cols, shift_n, scale_n, eps);
}

// Five rows an SM (≤ 96 registers, none spilled): measured on an H200 with CUDA events, 20 launches
// queued, 4680×5120 f32 → fp8 rowwise: 0.0355 ms at 5 (93% of a float4 copy's bandwidth), 0.0364
// at 6 (90%, a few spilled registers), 0.0365 at 7, 0.0415 at 8; 4 as 5. The whole-row path
// gains 1% over the predicated one. The narrow build: WL_NARROW_PER_SM rows an SM.
#define WL_NARROW_PER_SM 8
#define WL_NORM_FAST_BY(T, tn, P, pn, kind, V, PER_SM)                                                       \
    WL_KERNEL void WL_BOUNDS(WL_VEC_THREADS, PER_SM)                                                        \
        norm_modulate_##kind##_##tn##_##pn##_bf16(wl_bf16* out, const T* x, const P* shift, const P* scale, \
                                                  wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) { \
        norm_modulate_fast<T, P, V>(out, x, shift, scale, cols, shift_n, scale_n, eps);                     \
    }                                                                                                       \
    WL_KERNEL void WL_BOUNDS(WL_VEC_THREADS, PER_SM)                                                        \
        norm_modulate_##kind##_##tn##_##pn##_fp8(unsigned char* codes, float* scales, const T* x,           \
                                                 const P* shift, const P* scale, wl_u64 cols, wl_u64 shift_n, \
                                                 wl_u64 scale_n, float eps) {                               \
        norm_modulate_fast_fp8<T, P, V>(codes, scales, x, shift, scale, cols, shift_n, scale_n, eps);       \
    }
#define WL_NORM_FAST(T, tn, P, pn)                                                                          \
    WL_NORM_FAST_BY(T, tn, P, pn, fast, WL_VEC_VALUES, 5)                                                   \
    WL_NORM_FAST_BY(T, tn, P, pn, fastn, WL_NARROW_VALUES, WL_NARROW_PER_SM)

WL_NORM_FAST(float, f32, float, f32)
WL_NORM_FAST(float, f32, wl_bf16, bf16)
WL_NORM_FAST(wl_bf16, bf16, float, f32)
WL_NORM_FAST(wl_bf16, bf16, wl_bf16, bf16)

// ---- The residual stream's update and the norm after it, in one pass: r = x + y·gate (no gate:
// x + y; y + bias for a linear whose GEMM left its bias out), with a FiLM then r·(1 + fscale) + fshift, stored as the new stream, and "fast"'s norm +
// modulate of r from the registers it was computed in. The arithmetic of gated_residual(_modulate)
// or add, then norm_modulate_fast: the same bits as those kernels apart, with one read of the
// stream instead of two. The DiT's types: x, r f32; y bf16; gate, shift, scale f32; the FiLM (C)
// f32 or bf16, the bias f32. flags: 1 = gate, 2 = FiLM (an absent one's pointer is never read). The
// bias is a compile-time choice (its own kernels, `_bias`): its loads and pointer cost registers
// these kernels, at their 128-register bound, would spill, and the plain ones stay as they were.
template <typename C>
struct wl_residual {
    const float* x;
    const wl_bf16* y;
    const float* bias;
    const float* gate;
    const C* fshift;
    const C* fscale;
    float* r;
    wl_u64 gate_n, film_n;
    int flags;
};

// This row's residual values: each pointer at the row (a [cols] parameter wraps to its start).
template <typename C, bool BIAS>
struct wl_residual_row {
    const float *x, *gate, *bias;
    const wl_bf16* y;
    const C *fsh, *fsc;
    float* r;
    int flags;
    WL_DEVICE float at(unsigned int c) const {
        const float yc = BIAS ? wl_ld(y, c) + bias[c] : wl_ld(y, c);
        float v = fmaf(yc, (flags & 1) ? gate[c] : 1.0f, x[c]);
        return (flags & 2) ? fmaf(v, 1.0f + wl_ld(fsc, c), wl_ld(fsh, c)) : v;
    }
    WL_DEVICE void vec(float* d, unsigned int j) const {
        const wl_u64 i = (wl_u64)j * 4;
        float yv[4], g[4] = {1.0f, 1.0f, 1.0f, 1.0f};
        wl_ld4(d, x, i), wl_ld4(yv, y, i);
        if (flags & 1) wl_ld4(g, gate, i);
        if constexpr (BIAS) {
            float b[4];
            wl_ld4(b, bias, i);
#pragma unroll
            for (int c = 0; c < 4; ++c) yv[c] += b[c];
        }
#pragma unroll
        for (int c = 0; c < 4; ++c) d[c] = fmaf(yv[c], g[c], d[c]);
        if (flags & 2) {
            float a[4], b[4];
            wl_ld4(a, fsc, i), wl_ld4(b, fsh, i);
#pragma unroll
            for (int c = 0; c < 4; ++c) d[c] = fmaf(d[c], 1.0f + a[c], b[c]);
        }
    }
    WL_DEVICE void store(const float* d, unsigned int j) const { wl_st4(r, (wl_u64)j * 4, d); }
};

template <bool FULL, bool FP8, bool BIAS, typename C, int V>
WL_DEVICE void residual_norm_fast_rows(void* out, float* scales, const wl_residual<C>& in, const float* shift,
                                       const float* scale, wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) {
    const wl_u64 row = blockIdx.x, at = row * cols;
    const wl_residual_row<C, BIAS> rr{in.x + at,
                             in.gate + at % in.gate_n,
                             in.bias,
                             in.y + at,
                             in.fshift + at % in.film_n,
                             in.fscale + at % in.film_n,
                             in.r + at,
                             in.flags};
    float v[V];
    auto load = [&](float* d, unsigned int j) { rr.vec(d, j); };
    auto keep = [&](const float* d, unsigned int j) { rr.store(d, j); };
    wl_fast_row_by<4, float, FULL, V>(v, load, keep, (double)rr.at(0), cols, eps, shift + at % shift_n,
                                      scale + at % scale_n);
    const unsigned int nv = (unsigned int)(cols / 4);
    if constexpr (FP8)
        wl_fast_put_fp8<4, FULL, V>((unsigned char*)out + at, scales + row, v, nv);
    else
        wl_fast_put_bf16<4, FULL, V>((wl_bf16*)out + at, v, nv);
}

// With a bias only the predicated path: on an H100 the whole-row one with a bias (5120 columns)
// faulted with an illegal address, while the predicated one ran at 1536 columns, and the emulator,
// compiling the same source without the register bound, passed both.
template <bool FP8, bool BIAS, typename C, int V>
WL_DEVICE void residual_norm_fast(void* out, float* scales, const wl_residual<C>& in, const float* shift,
                                  const float* scale, wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) {
    if constexpr (!BIAS && V == WL_VEC_VALUES) {
        if (cols == (wl_u64)V * WL_VEC_THREADS) {
            residual_norm_fast_rows<true, FP8, BIAS, C, V>(out, scales, in, shift, scale, cols, shift_n, scale_n, eps);
            return;
        }
    }
    residual_norm_fast_rows<false, FP8, BIAS, C, V>(out, scales, in, shift, scale, cols, shift_n, scale_n, eps);
}

// The operands as plain parameters (both vendors' launchers pass them so), gathered here; one
// kernel per build (kind: fast or fastn, V values a thread), FiLM type (C, suffix cn), output,
// and bias or none (B: false or true, suffix bn).
#define WL_RESIDUAL_NORM(kind, V, C, cn, B, bn, PER_SM)                                                    \
    WL_KERNEL void WL_BOUNDS(WL_VEC_THREADS, PER_SM) residual_norm_##kind##bn##_##cn##_bf16(               \
        wl_bf16* out, const float* x, const wl_bf16* y, const float* bias, const float* gate, const C* fshift, \
        const C* fscale, float* r, wl_u64 gate_n, wl_u64 film_n, int flags, const float* shift, const float* scale, \
        wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) {                                           \
        const wl_residual<C> in{x, y, bias, gate, fshift, fscale, r, gate_n, film_n, flags};               \
        residual_norm_fast<false, B, C, V>(out, nullptr, in, shift, scale, cols, shift_n, scale_n, eps);    \
    }                                                                                                       \
    WL_KERNEL void WL_BOUNDS(WL_VEC_THREADS, PER_SM) residual_norm_##kind##bn##_##cn##_fp8(                \
        unsigned char* codes, float* scales, const float* x, const wl_bf16* y, const float* bias,          \
        const float* gate, const C* fshift, const C* fscale, float* r, wl_u64 gate_n, wl_u64 film_n, int flags, \
        const float* shift, const float* scale, wl_u64 cols, wl_u64 shift_n, wl_u64 scale_n, float eps) {  \
        const wl_residual<C> in{x, y, bias, gate, fshift, fscale, r, gate_n, film_n, flags};               \
        residual_norm_fast<true, B, C, V>(codes, scales, in, shift, scale, cols, shift_n, scale_n, eps);    \
    }
WL_RESIDUAL_NORM(fast, WL_VEC_VALUES, float, f32, false, , 4)
WL_RESIDUAL_NORM(fast, WL_VEC_VALUES, wl_bf16, bf16, false, , 4)
// Three blocks an SM for the bias kernels: at four they spilled 72–88 bytes a thread.
WL_RESIDUAL_NORM(fast, WL_VEC_VALUES, float, f32, true, _bias, 3)
WL_RESIDUAL_NORM(fast, WL_VEC_VALUES, wl_bf16, bf16, true, _bias, 3)
WL_RESIDUAL_NORM(fastn, WL_NARROW_VALUES, float, f32, false, , WL_NARROW_PER_SM)
WL_RESIDUAL_NORM(fastn, WL_NARROW_VALUES, wl_bf16, bf16, false, , WL_NARROW_PER_SM)
WL_RESIDUAL_NORM(fastn, WL_NARROW_VALUES, float, f32, true, _bias, WL_NARROW_PER_SM)
WL_RESIDUAL_NORM(fastn, WL_NARROW_VALUES, wl_bf16, bf16, true, _bias, WL_NARROW_PER_SM)
