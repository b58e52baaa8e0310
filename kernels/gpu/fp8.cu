// fp8 e4m3fn quantization with scale = max(amax / 448, 1e-12), rowwise (one block per row) or
// tensorwise (partial amax per block, one finishing block, then the encode: no host round trip).

WL_DEVICE float wl_e4m3_value(unsigned char code) {
    const float sign = (code & 0x80) ? -1.0f : 1.0f;
    const int e = (code >> 3) & 15, m = code & 7;
    if (e == 15 && m == 7) return __uint_as_float(0x7fc00000u);
    const float mag = e == 0 ? (float)m * 0.001953125f : (1.0f + (float)m * 0.125f) * __uint_as_float((unsigned int)(e - 7 + 127) << 23);
    return sign * mag;
}

template <typename T>
WL_DEVICE void quant_rows(unsigned char* codes, float* scales, const T* x, wl_u64 cols) {
    __shared__ float scratch[32];
    const wl_u64 row = blockIdx.x;
    const T* xr = x + row * cols;
    float a = 0.0f;
    for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x) a = fmaxf(a, fabsf(wl_ld(xr, c)));
    const float scale = fmaxf(wl_block_max(a, scratch) / 448.0f, 1e-12f);
    const float inv = 1.0f / scale;
    for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x) codes[row * cols + c] = wl_to_e4m3(wl_ld(xr, c) * inv);
    if (threadIdx.x == 0) scales[row] = scale;
}

// quant_rows for rows of a multiple of 16 bytes (8 bf16 or 4 f32 values): 16-byte loads and
// 8- or 4-byte code stores instead of an element (and a byte store) a thread. The row is read
// twice, the second time from L1/L2 (a 13824-wide bf16 row is 27 KiB), which is cheaper than
// holding rows of any width in registers. Same codes as quant_rows.
template <typename T>
WL_DEVICE void quant_rows_vec(unsigned char* codes, float* scales, const T* x, wl_u64 cols) {
    constexpr int N = WlVec<T>::N;
    __shared__ float scratch[32];
    const wl_u64 row = blockIdx.x;
    const T* xr = x + row * cols;
    const unsigned int nv = (unsigned int)(cols / N);
    float a = 0.0f;
    for (unsigned int j = threadIdx.x; j < nv; j += blockDim.x) {
        float v[N];
        WlVec<T>::load(v, xr, j);
#pragma unroll
        for (int c = 0; c < N; ++c) a = fmaxf(a, fabsf(v[c]));
    }
    const float scale = fmaxf(wl_block_max(a, scratch) / 448.0f, 1e-12f);
    const float inv = 1.0f / scale;
    unsigned char* cr = codes + row * cols;
    for (unsigned int j = threadIdx.x; j < nv; j += blockDim.x) {
        float v[N];
        WlVec<T>::load(v, xr, j);
        if constexpr (N == 8)
            ((uint2*)cr)[j] = make_uint2(wl_pack_e4m3_lean(v, inv), wl_pack_e4m3_lean(v + 4, inv));
        else
            ((unsigned int*)cr)[j] = wl_pack_e4m3_lean(v, inv);
    }
    if (threadIdx.x == 0) scales[row] = scale;
}

// quant_rows_vec with the row held in registers (as loaded: up to WL_QUANT_HELD 16-byte
// vectors a thread, a 16384-wide bf16 row at 256 threads): every load of the row is issued
// before the first is used, and the row is read once. The second read of quant_rows_vec, and
// its loads waiting on each other one vector a thread at a time, held the FFN's 13824-wide
// activations at ~78 % of the copy bandwidth on an H100. Same codes as quant_rows. Launched with
// 256 threads (the bound lets HIP's compiler keep the row: it assumes 1024 threads otherwise).
#define WL_QUANT_HELD 8
// BIAS_GELU (bf16 rows only): the row is first gelu_tanh(x + bias), bias f32 `[cols]`, rounded
// to bf16 in the registers that held x, as a GEMM's bias + GELU epilogue would have stored it;
// the quantization is then quant_rows'. The FFN's first linear then runs as a plain GEMM (its
// plain plan is faster than its bias + GELU one) and this pass, which reads its output anyway,
// adds the rest.
template <typename T, bool BIAS_GELU = false>
WL_DEVICE void quant_rows_held(unsigned char* codes, float* scales, const T* x, wl_u64 cols,
                               const float* bias = nullptr) {
    constexpr int N = WlVec<T>::N;
    __shared__ float scratch[32];
    const wl_u64 row = blockIdx.x;
    const uint4* xr = (const uint4*)(x + row * cols);
    const unsigned int nv = (unsigned int)(cols / N);
    uint4 held[WL_QUANT_HELD];
#pragma unroll
    for (int i = 0; i < WL_QUANT_HELD; ++i) {
        const unsigned int j = threadIdx.x + i * blockDim.x;
        if (j < nv) held[i] = xr[j];
    }
    float a = 0.0f;
#pragma unroll
    for (int i = 0; i < WL_QUANT_HELD; ++i) {
        const unsigned int j = threadIdx.x + i * blockDim.x;
        if (j < nv) {
            float v[N];
            wl_unpack16(v, held[i], x);
            if constexpr (BIAS_GELU) {
                static_assert(N == 8, "bias + GELU rows are bf16");
                float b[N];
                wl_ld_f32s<N>(b, bias, j);
#pragma unroll
                for (int c = 0; c < N; ++c) v[c] = wl_as_stored<wl_bf16>(wl_gelu_tanh(v[c] + b[c]));
                held[i] = make_uint4(wl_pack_bf16(v[0], v[1]), wl_pack_bf16(v[2], v[3]), wl_pack_bf16(v[4], v[5]),
                                     wl_pack_bf16(v[6], v[7]));
            }
#pragma unroll
            for (int c = 0; c < N; ++c) a = fmaxf(a, fabsf(v[c]));
        }
    }
    const float scale = fmaxf(wl_block_max(a, scratch) / 448.0f, 1e-12f);
    const float inv = 1.0f / scale;
    unsigned char* cr = codes + row * cols;
#pragma unroll
    for (int i = 0; i < WL_QUANT_HELD; ++i) {
        const unsigned int j = threadIdx.x + i * blockDim.x;
        if (j < nv) {
            float v[N];
            wl_unpack16(v, held[i], x);
            if constexpr (N == 8)
                ((uint2*)cr)[j] = make_uint2(wl_pack_e4m3_lean(v, inv), wl_pack_e4m3_lean(v + 4, inv));
            else
                ((unsigned int*)cr)[j] = wl_pack_e4m3_lean(v, inv);
        }
    }
    if (threadIdx.x == 0) scales[row] = scale;
}

template <typename T>
WL_DEVICE void amax_partial(float* partial, const T* x, wl_u64 n) {
    __shared__ float scratch[32];
    float a = 0.0f;
    WL_GRID_STRIDE(i, n) { a = fmaxf(a, fabsf(wl_ld(x, i))); }
    a = wl_block_max(a, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = a;
}

template <typename T>
WL_DEVICE void quant_tensor(unsigned char* codes, const float* scale, const T* x, wl_u64 n) {
    const float inv = 1.0f / scale[0];
    WL_GRID_STRIDE(i, n) { codes[i] = wl_to_e4m3(wl_ld(x, i) * inv); }
}

template <typename T>
WL_DEVICE void dequant(T* out, const unsigned char* codes, const float* scales, wl_u64 n, wl_u64 cols, int rowwise) {
    WL_GRID_STRIDE(i, n) { wl_st(out, i, wl_e4m3_value(codes[i]) * scales[rowwise ? i / cols : 0]); }
}

WL_KERNEL void amax_finish(float* scale, const float* partial, int parts) {
    __shared__ float scratch[32];
    float a = 0.0f;
    for (int i = threadIdx.x; i < parts; i += blockDim.x) a = fmaxf(a, partial[i]);
    a = wl_block_max(a, scratch);
    if (threadIdx.x == 0) scale[0] = fmaxf(a / 448.0f, 1e-12f);
}

#define WL_FP8(T, tn)                                                                                     \
    WL_KERNEL void quant_rows_##tn(unsigned char* codes, float* scales, const T* x, wl_u64 cols) {       \
        quant_rows(codes, scales, x, cols);                                                              \
    }                                                                                                    \
    WL_KERNEL void quant_rows_vec_##tn(unsigned char* codes, float* scales, const T* x, wl_u64 cols) {   \
        quant_rows_vec(codes, scales, x, cols);                                                          \
    }                                                                                                    \
    WL_KERNEL void WL_BOUNDS(256, 5)                                                                     \
        quant_rows_held_##tn(unsigned char* codes, float* scales, const T* x, wl_u64 cols) {             \
        quant_rows_held(codes, scales, x, cols);                                                         \
    }                                                                                                    \
    WL_KERNEL void amax_partial_##tn(float* partial, const T* x, wl_u64 n) { amax_partial(partial, x, n); } \
    WL_KERNEL void quant_tensor_##tn(unsigned char* codes, const float* scale, const T* x, wl_u64 n) {   \
        quant_tensor(codes, scale, x, n);                                                                \
    }                                                                                                    \
    WL_KERNEL void dequant_##tn(T* out, const unsigned char* codes, const float* scales, wl_u64 n, wl_u64 cols, \
                                int rowwise) {                                                           \
        dequant(out, codes, scales, n, cols, rowwise);                                                   \
    }

WL_FP8(float, f32)
WL_FP8(wl_bf16, bf16)
WL_KERNEL void WL_BOUNDS(256, 4) quant_rows_held_bias_gelu_bf16(unsigned char* codes, float* scales, const wl_bf16* x,
                                                                const float* bias, wl_u64 cols) {
    quant_rows_held<wl_bf16, true>(codes, scales, x, cols, bias);
}

// out[m, n] *= sx[m or 0] · sw[n or 0]: the rowwise scales of an fp8 GEMM run with unit scales.
WL_KERNEL void scale_rows_cols_bf16(wl_bf16* out, const float* sx, int x_rows, const float* sw, int w_rows, wl_u64 m,
                                    wl_u64 n) {
    WL_GRID_STRIDE(i, m * n) {
        const wl_u64 r = i / n, c = i % n;
        const float s = sx[x_rows ? r : 0] * sw[w_rows ? c : 0];
        out[i] = wl_to_bf16(wl_ld(out, i) * s);
    }
}

// OCP e4m3fn codes as the fnuz e4m3 codes (gfx942's matrix cores) of half their value: the same
// bits with exponent bias 8, except -0 (0x80, NaN in fnuz) and NaN (0x7f/0xff, finite in fnuz).
WL_KERNEL void e4m3fn_to_fnuz(unsigned char* out, const unsigned char* in, wl_u64 n) {
    WL_GRID_STRIDE(i, n) {
        const unsigned char c = in[i];
        out[i] = c == 0x80 ? 0 : ((c & 0x7f) == 0x7f ? 0x80 : c);
    }
}
