// Shared device helpers: element loads/stores for f32 and bf16 (bf16 stored as its 16 bits),
// the e4m3fn codec, block reductions. Included after a vendor header.

typedef unsigned short wl_bf16;

#define WL_INF __uint_as_float(0x7f800000u)

WL_DEVICE float wl_ld(const float* p, wl_u64 i) { return p[i]; }
WL_DEVICE float wl_ld(const wl_bf16* p, wl_u64 i) { return __uint_as_float(((unsigned int)p[i]) << 16); }

// Round to nearest even, NaN kept quiet: the `half` crate's rule, so GPU and CPU bf16 agree.
WL_DEVICE wl_bf16 wl_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (wl_bf16)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (wl_bf16)(u >> 16);
}
WL_DEVICE void wl_st(float* p, wl_u64 i, float v) { p[i] = v; }
WL_DEVICE void wl_st(wl_bf16* p, wl_u64 i, float v) { p[i] = wl_to_bf16(v); }

// VSA's coarse term of one output element (kernels/src/vsa.rs's `Coarse`, the kernels' `mix`):
// the coarse output `c[0]` added (0), gated by `gate[at]` (1), or nothing (2: select-only, where
// the coarse buffer is never written, so it must not be read).
template <typename T>
WL_DEVICE float wl_vsa_coarse(int mix, const T* gate, wl_u64 at, const float* c) {
    if (mix == 2) return 0.0f;
    return (mix == 1 ? wl_ld(gate, at) : 1.0f) * c[0];
}

// e4m3fn: round to nearest even, saturate at ±448, NaN → 0x7f (kernels/src/fp8.rs is the
// reference). Software encode keeps one source for every target; hardware cvt is a later speed-up.
WL_DEVICE unsigned char wl_to_e4m3(float x) {
    if (x != x) return 0x7f;
    unsigned char sign = (__float_as_uint(x) >> 31) ? 0x80 : 0;
    float a = fabsf(x);
    if (a >= 448.0f) return sign | 0x7e;
    unsigned int code;
    if (a < 0.015625f) {
        code = (unsigned int)rintf(a * 512.0f);
    } else {
        int e = (int)((__float_as_uint(a) >> 23) & 0xff) - 127;
        int q = (int)rintf(a * __uint_as_float((unsigned int)(127 + 3 - e) << 23));
        code = (unsigned int)(((e + 7) << 3) + (q - 8));
    }
    return sign | (unsigned char)code;
}

// A value as stored in T and read back: what the next kernel reads after one wrote it (fused
// kernels round their intermediates so, to give the unfused kernels' results bit for bit).
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

// Reduction over a block whose size is a multiple of the warp size (≤ 1024): every thread gets
// the result. `scratch` holds one value per warp.
struct WlSum {
    template <typename V>
    WL_DEVICE V operator()(V a, V b) const { return a + b; }
};
struct WlMax {
    WL_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); }
};

template <typename V, typename Op>
WL_DEVICE V wl_block_reduce(V v, V* scratch, Op op) {
    for (int m = WL_WARP_SIZE / 2; m > 0; m >>= 1) v = op(v, wl_shfl_xor(v, m));
    const int warp = threadIdx.x / WL_WARP_SIZE, lane = threadIdx.x % WL_WARP_SIZE;
    const int warps = blockDim.x / WL_WARP_SIZE;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    V t = scratch[0];
    for (int w = 1; w < warps; ++w) t = op(t, scratch[w]);
    return t;
}

WL_DEVICE float wl_block_sum(float v, float* scratch) { return wl_block_reduce(v, scratch, WlSum()); }
WL_DEVICE double wl_block_sum_f64(double v, double* scratch) { return wl_block_reduce(v, scratch, WlSum()); }
WL_DEVICE float wl_block_max(float v, float* scratch) { return wl_block_reduce(v, scratch, WlMax()); }

#define WL_GRID_STRIDE(i, n) \
    for (wl_u64 i = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (wl_u64)gridDim.x * blockDim.x)

WL_DEVICE unsigned int wl_pack_bf16(float lo, float hi) {
    return (unsigned int)wl_to_bf16(lo) | ((unsigned int)wl_to_bf16(hi) << 16);
}

// i % m, in 32 bits when both fit: a 64-bit remainder is a long software routine on GPUs, and an
// element-wise kernel that takes one per parameter per element is bound by it, not by memory.
WL_DEVICE wl_u64 wl_rem(wl_u64 i, wl_u64 m) {
    return ((i | m) >> 32) ? i % m : (wl_u64)((unsigned int)i % (unsigned int)m);
}

// Elements i .. i + 3 (i a multiple of four, the buffer's start 16-byte aligned) as f32, in one
// load; and four values stored with wl_st's rounding.
WL_DEVICE void wl_ld4(float* v, const float* p, wl_u64 i) {
    const float4 r = *(const float4*)(p + i);
    v[0] = r.x, v[1] = r.y, v[2] = r.z, v[3] = r.w;
}
WL_DEVICE void wl_ld4(float* v, const wl_bf16* p, wl_u64 i) {
    const uint2 r = *(const uint2*)(p + i);
    v[0] = __uint_as_float(r.x << 16), v[1] = __uint_as_float(r.x & 0xffff0000u);
    v[2] = __uint_as_float(r.y << 16), v[3] = __uint_as_float(r.y & 0xffff0000u);
}
WL_DEVICE void wl_st4(float* p, wl_u64 i, const float* v) { *(float4*)(p + i) = make_float4(v[0], v[1], v[2], v[3]); }
WL_DEVICE void wl_st4(wl_bf16* p, wl_u64 i, const float* v) {
    *(uint2*)(p + i) = make_uint2(wl_pack_bf16(v[0], v[1]), wl_pack_bf16(v[2], v[3]));
}

// A loaded 16-byte vector's values as f32 (WlVec's load, from a register).
WL_DEVICE void wl_unpack16(float* v, const uint4& r, const wl_bf16*) {
    const unsigned int w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        v[2 * k] = __uint_as_float(w[k] << 16);
        v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
    }
}
WL_DEVICE void wl_unpack16(float* v, const uint4& r, const float*) {
    v[0] = __uint_as_float(r.x), v[1] = __uint_as_float(r.y);
    v[2] = __uint_as_float(r.z), v[3] = __uint_as_float(r.w);
}

// A row's vector j (16 bytes: 8 bf16 or 4 f32 values) as f32 values.
template <typename T>
struct WlVec;
template <>
struct WlVec<wl_bf16> {
    static constexpr int N = 8;
    static WL_DEVICE void load(float* v, const wl_bf16* row, unsigned int j) {
        const uint4 r = ((const uint4*)row)[j];
        const unsigned int w[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[2 * k] = __uint_as_float(w[k] << 16);
            v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
        }
    }
    // wl_st's rounding (wl_to_bf16), eight values at once.
    static WL_DEVICE void store(wl_bf16* row, unsigned int j, const float* v) {
        ((uint4*)row)[j] = make_uint4(wl_pack_bf16(v[0], v[1]), wl_pack_bf16(v[2], v[3]), wl_pack_bf16(v[4], v[5]),
                                      wl_pack_bf16(v[6], v[7]));
    }
};
template <>
struct WlVec<float> {
    static constexpr int N = 4;
    static WL_DEVICE void load(float* v, const float* row, unsigned int j) {
        const float4 r = ((const float4*)row)[j];
        v[0] = r.x;
        v[1] = r.y;
        v[2] = r.z;
        v[3] = r.w;
    }
    static WL_DEVICE void store(float* row, unsigned int j, const float* v) {
        ((float4*)row)[j] = make_float4(v[0], v[1], v[2], v[3]);
    }
};

// N f32 parameters (a gain) of vector j of a row.
template <int N>
WL_DEVICE void wl_ld_f32s(float* g, const float* row, unsigned int j) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) WlVec<float>::load(g + 4 * i, row, (N / 4) * j + i);
}

// A row's vector j, or element c, as f32 with `bias` (f32, one per column; null: none) added:
// the bias of a linear whose GEMM left it out, added where its output is read next.
template <typename T>
WL_DEVICE void wl_load_biased(float* v, const T* row, const float* bias, unsigned int j) {
    constexpr int N = WlVec<T>::N;
    WlVec<T>::load(v, row, j);
    if (bias) {
        float b[N];
        wl_ld_f32s<N>(b, bias, j);
#pragma unroll
        for (int c = 0; c < N; ++c) v[c] += b[c];
    }
}
template <typename T>
WL_DEVICE float wl_ld_biased(const T* row, const float* bias, wl_u64 c) {
    const float v = wl_ld(row, c);
    return bias ? v + bias[c] : v;
}

// Σ x² over a row (x + bias where `bias` is given), accumulated in f64 (a vector's squares in
// f32), in an order fixed by the block size and `cols` alone: norm.cu's rms_norm and rope.cu's
// rms_norm_rope both take it, so the fused op's normalisation is the plain one's bit for bit.
// 16-byte vectors where the row is a whole number of them (the loads go out together instead of
// one element a thread waiting on each), else elements.
template <typename T>
WL_DEVICE double wl_row_sumsq(const T* xr, const float* bias, wl_u64 cols, double* scratch) {
    constexpr int N = WlVec<T>::N;
    double s = 0.0;
    if (cols % N == 0) {
        const unsigned int nv = (unsigned int)(cols / N);
        for (unsigned int j = threadIdx.x; j < nv; j += blockDim.x) {
            float v[N];
            wl_load_biased(v, xr, bias, j);
            // A vector's squares summed in f32 and converted once: f64 conversions run at an
            // eighth of f32 math's rate on Hopper, and one a value bound the q/k norms.
            float q = 0.f;
#pragma unroll
            for (int c = 0; c < N; ++c) q = fmaf(v[c], v[c], q);
            s += (double)q;
        }
    } else {
        for (wl_u64 c = threadIdx.x; c < cols; c += blockDim.x) {
            const double d = (double)wl_ld_biased(xr, bias, c);
            s += d * d;
        }
    }
    return wl_block_sum_f64(s, scratch);
}

// wl_to_e4m3's codes (checked equal on all 2^32 floats) without its branch and its two
// float→int conversions: magnitudes from 448 up (and ±inf) clamp to 448, code 0x7e; normal
// values round their mantissa to 3 bits in the integer bits (a carry moves into the exponent, as
// a rounding up to the next binade should); below 2^-6 the f32 addition to 2^14 rounds to the
// multiples of 2^-9 that are the subnormal codes.
WL_DEVICE unsigned int wl_e4m3_lean(float x) {
    const float af = fminf(fabsf(x), 448.0f);
    const unsigned int a = __float_as_uint(af);
    unsigned int c = ((a + 0x7ffffu + ((a >> 20) & 1u)) >> 20) - (120u << 3);
    if (af < 0.015625f) c = __float_as_uint(af + 16384.0f) - 0x46800000u;
    c |= (__float_as_uint(x) >> 24) & 0x80u;
    return x != x ? 0x7fu : c;
}
WL_DEVICE unsigned int wl_pack_e4m3_lean(const float* v, float r) {
#if defined(WL_HAS_CVT_E4M3)
    // The hardware conversion where there is one: two instructions for four codes.
    return wl_cvt_e4m3x2(v[0] * r, v[1] * r) | (wl_cvt_e4m3x2(v[2] * r, v[3] * r) << 16);
#else
    return wl_e4m3_lean(v[0] * r) | (wl_e4m3_lean(v[1] * r) << 8) | (wl_e4m3_lean(v[2] * r) << 16) |
           (wl_e4m3_lean(v[3] * r) << 24);
#endif
}

// GELU, tanh form (Wan's FFN): elementwise.cu's gelu_tanh and fp8.cu's fused bias + GELU +
// quantization evaluate the same expression.
WL_DEVICE float wl_gelu_tanh(float x) {
    return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
}
