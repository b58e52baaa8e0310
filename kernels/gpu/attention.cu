// Attention over a KV cache, correctness first: one warp per (query, head), keys in groups of a
// warp (each lane scores one key), online softmax in f32, each lane accumulating the output dims
// lane, lane + W, … The tiled tensor-core kernel replaces this for speed; this one is the GPU
// reference it will be checked against.

#define WL_ATT_MAX_D 512
#define WL_ATT_WARPS 4

// `bias` (null for none): an f32 [heads, 2·span − 1] table added to the logits by key − query
// offset (T5's relative position bias).
template <typename T>
WL_DEVICE void attention(T* out, const T* q, const T* k, const T* v, int lq, int kv_len, int heads, int d,
                         int block_tokens, float scale, const float* bias, int span) {
    __shared__ float qs[WL_ATT_WARPS][WL_ATT_MAX_D];
    const int warp = threadIdx.x / WL_WARP_SIZE, lane = threadIdx.x % WL_WARP_SIZE;
    const wl_u64 job = (wl_u64)blockIdx.x * WL_ATT_WARPS + warp;
    const bool active = job < (wl_u64)lq * heads;
    const int qi = active ? (int)(job / heads) : 0, h = active ? (int)(job % heads) : 0;
    const wl_u64 row = (wl_u64)heads * d;
    for (int e = lane; e < d; e += WL_WARP_SIZE) qs[warp][e] = active ? wl_ld(q, qi * row + (wl_u64)h * d + e) : 0.0f;
    __syncthreads();
    if (!active) return;
    int limit = kv_len;
    if (block_tokens > 0) limit = min(kv_len, (qi / block_tokens + 1) * block_tokens);

    const int per_lane = (d + WL_WARP_SIZE - 1) / WL_WARP_SIZE;
    float acc[WL_ATT_MAX_D / 32];
    for (int e = 0; e < WL_ATT_MAX_D / 32; ++e) acc[e] = 0.0f;
    float m = -WL_INF, l = 0.0f;
    for (int base = 0; base < limit; base += WL_WARP_SIZE) {
        const int key = base + lane;
        float s = -WL_INF;
        if (key < limit) {
            const T* kr = k + key * row + (wl_u64)h * d;
            float dot = 0.0f;
            for (int e = 0; e < d; ++e) dot += qs[warp][e] * wl_ld(kr, e);
            s = dot * scale;
            if (bias) s += bias[(wl_u64)h * (2 * span - 1) + (span - 1) + key - qi];
        }
        float mx = s;
        for (int o = WL_WARP_SIZE / 2; o > 0; o >>= 1) mx = fmaxf(mx, wl_shfl_xor(mx, o));
        const float m_new = fmaxf(m, mx);
        const float p = key < limit ? expf(s - m_new) : 0.0f;
        const float corr = expf(m - m_new);
        float ps = p;
        for (int o = WL_WARP_SIZE / 2; o > 0; o >>= 1) ps += wl_shfl_xor(ps, o);
        l = l * corr + ps;
        for (int e = 0; e < per_lane; ++e) acc[e] *= corr;
        const int n = min(WL_WARP_SIZE, limit - base);
        for (int t = 0; t < n; ++t) {
            const float pt = wl_shfl(p, t);
            const T* vr = v + (base + t) * row + (wl_u64)h * d;
            for (int e = 0; e < per_lane; ++e) {
                const int dim = lane + e * WL_WARP_SIZE;
                if (dim < d) acc[e] += pt * wl_ld(vr, dim);
            }
        }
        m = m_new;
    }
    const float inv = 1.0f / l;
    for (int e = 0; e < per_lane; ++e) {
        const int dim = lane + e * WL_WARP_SIZE;
        if (dim < d) wl_st(out, qi * row + (wl_u64)h * d + dim, acc[e] * inv);
    }
}

#define WL_ATT(T, tn)                                                                                      \
    WL_KERNEL void attention_##tn(T* out, const T* q, const T* k, const T* v, int lq, int kv_len, int heads, \
                                  int d, int block_tokens, float scale) {                                  \
        attention(out, q, k, v, lq, kv_len, heads, d, block_tokens, scale, (const float*)0, 0);            \
    }                                                                                                      \
    WL_KERNEL void attention_bias_##tn(T* out, const T* q, const T* k, const T* v, int lq, int kv_len,      \
                                       int heads, int d, float scale, const float* bias, int span) {        \
        attention(out, q, k, v, lq, kv_len, heads, d, 0, scale, bias, span);                               \
    }

WL_ATT(float, f32)
WL_ATT(wl_bf16, bf16)

// T5's attention at head dims up to 64 (`bias` and `span` as above, never null here): a block
// takes 32 queries of one head and walks the keys in tiles of 32 staged in shared memory, so a
// key is read from memory once per 32 queries (the kernel above reads every key once per query:
// 5.4 ms a umT5 layer at 512 tokens on an H200). Four threads per query: each scores 8 keys of
// the tile, then all four update the query's online softmax in f32 and accumulate every fourth
// output dim. Rows are padded by one float so the 8 queries of a warp hit distinct banks.
#define TB_Q 32
#define TB_K 32
#define TB_D 64
#define TB_PITCH (TB_D + 1)
#define TB_THREADS 128
#define TB_PER_ROW (TB_THREADS / TB_Q)

template <typename T>
WL_DEVICE void attention_bias_tiled(T* out, const T* q, const T* k, const T* v, int lq, int kv_len, int heads, int d,
                                    float scale, const float* bias, int span) {
    __shared__ float qs[TB_Q][TB_PITCH];
    __shared__ float ks[TB_K][TB_PITCH];
    __shared__ float vs[TB_K][TB_PITCH];
    __shared__ float ss[TB_Q][TB_K + 1];
    const int h = blockIdx.y, q0 = blockIdx.x * TB_Q;
    const int tid = threadIdx.x, r = tid / TB_PER_ROW, part = tid % TB_PER_ROW;
    const int qi = q0 + r;
    const bool live = qi < lq;
    const wl_u64 row = (wl_u64)heads * d;
    for (int i = tid; i < TB_Q * d; i += TB_THREADS) {
        const int rr = i / d, c = i % d;
        qs[rr][c] = q0 + rr < lq ? wl_ld(q, (wl_u64)(q0 + rr) * row + (wl_u64)h * d + c) : 0.0f;
    }
    // The query's bias row, indexed by key: entry j is offset j − qi.
    const float* hb = live ? bias + (wl_u64)h * (2 * span - 1) + (span - 1) - qi : bias;
    float acc[TB_D / TB_PER_ROW];
#pragma unroll
    for (int m = 0; m < TB_D / TB_PER_ROW; ++m) acc[m] = 0.0f;
    float mx = -WL_INF, l = 0.0f;
    for (int k0 = 0; k0 < kv_len; k0 += TB_K) {
        __syncthreads();  // the last tile's readers are done (the first time: qs is written)
        for (int i = tid; i < TB_K * d; i += TB_THREADS) {
            const int j = i / d, c = i % d;
            const bool in = k0 + j < kv_len;
            const wl_u64 at = (wl_u64)(in ? k0 + j : 0) * row + (wl_u64)h * d + c;
            ks[j][c] = in ? wl_ld(k, at) : 0.0f;
            vs[j][c] = in ? wl_ld(v, at) : 0.0f;
        }
        __syncthreads();
        for (int m = 0; m < TB_K / TB_PER_ROW; ++m) {
            const int j = part + m * TB_PER_ROW;
            float dot = 0.0f;
            for (int c = 0; c < d; ++c) dot += qs[r][c] * ks[j][c];
            ss[r][j] = live && k0 + j < kv_len ? dot * scale + hb[k0 + j] : -WL_INF;
        }
        __syncthreads();
        if (!live) continue;
        float tmax = -WL_INF;
        for (int j = 0; j < TB_K; ++j) tmax = fmaxf(tmax, ss[r][j]);
        const float mnew = fmaxf(mx, tmax);  // finite: every tile walked holds a visible key
        const float corr = expf(mx - mnew);
        l *= corr;
#pragma unroll
        for (int m = 0; m < TB_D / TB_PER_ROW; ++m) acc[m] *= corr;
        for (int j = 0; j < TB_K; ++j) {
            const float p = expf(ss[r][j] - mnew);
            l += p;
#pragma unroll
            for (int m = 0; m < TB_D / TB_PER_ROW; ++m) {
                const int e = part + m * TB_PER_ROW;
                if (e < d) acc[m] += p * vs[j][e];
            }
        }
        mx = mnew;
    }
    if (!live) return;
    const float inv = 1.0f / l;
#pragma unroll
    for (int m = 0; m < TB_D / TB_PER_ROW; ++m) {
        const int e = part + m * TB_PER_ROW;
        if (e < d) wl_st(out, (wl_u64)qi * row + (wl_u64)h * d + e, acc[m] * inv);
    }
}

// Its block size as a bound: without one, HIP compiles for blocks of up to 1024 threads and caps
// a thread at 128 VGPRs, and this kernel then spilled 33–49 of them to scratch.
#define WL_ATT_TILED(T, tn)                                                                                  \
    WL_KERNEL void __launch_bounds__(TB_THREADS) attention_bias_tiled_##tn(T* out, const T* q, const T* k, const T* v, int lq, int kv_len, \
                                             int heads, int d, float scale, const float* bias, int span) {     \
        attention_bias_tiled(out, q, k, v, lq, kv_len, heads, d, scale, bias, span);                          \
    }

WL_ATT_TILED(float, f32)
WL_ATT_TILED(wl_bf16, bf16)

#if defined(WL_HAS_MMA_BF16)
// Flash attention forward on tensor cores (mma.sync, sm_80+; Hopper takes the wgmma kernels
// below): bf16 q/k/v [L, heads, 128], f32 accumulation and online softmax (base 2), bf16 out. A
// block of 4 warps takes 128 queries of one head (staged in shared memory); each warp owns 32 of
// them as two 16-row halves, so every K and V fragment read from shared memory feeds two MMAs
// (with one 16-row half per warp, ldmatrix traffic bounded the kernel). Keys go by in tiles of
// BC, double-buffered with cp.async so the next tile loads while this one is multiplied; two
// blocks share an SM (2 × 104 KiB of shared memory at BC = 64). Keys past `kv_len`, or past a
// query's chunk when `block_tokens > 0`, are masked; tiles that no row of a warp can see past
// are not.
#define FA_D 128
#define FA_WARPS 4
#define FA_BR (32 * FA_WARPS)
#define FA_PAD (FA_D + 8)

WL_DEVICE void fa_load_rows(wl_bf16* dst, const wl_bf16* src, int first, int rows, int limit, wl_u64 row, int h) {
    for (int i = threadIdx.x; i < rows * FA_D / 8; i += blockDim.x) {
        const int r = i / (FA_D / 8), c8 = (i % (FA_D / 8)) * 8;
        const bool valid = first + r < limit;
        const wl_u64 at = (wl_u64)(valid ? first + r : 0) * row + (wl_u64)h * FA_D + c8;
        wl_cp_async16(dst + r * FA_PAD + c8, src + at, valid);
    }
}

template <int BC>
WL_DEVICE void flash_attention_d128(wl_bf16* out, const wl_bf16* q, const wl_bf16* k, const wl_bf16* v, int lq,
                                    int kv_len, int heads, int block_tokens, float scale) {
    constexpr int TILE = BC * FA_PAD;
    constexpr int NJ = BC / 8;  // 8-key groups per tile
    extern __shared__ __align__(16) unsigned char fa_smem[];
    wl_bf16* qs = (wl_bf16*)fa_smem;
    wl_bf16* tiles = qs + FA_BR * FA_PAD;  // [stage][K|V][TILE]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = blockIdx.y;
    const int qb = blockIdx.x * FA_BR;
    const wl_u64 row = (wl_u64)heads * FA_D;
    // This thread's rows: row0 + 16·i + 8·e for half i, accumulator pair e.
    const int row0 = qb + warp * 32 + lane / 4;
    const int cq = (lane % 4) * 2;
    // Scores in base 2: exp(x·scale) = exp2(x·scale·log2 e).
    const float scale2 = scale * 1.4426950408889634f;

    int block_end = kv_len;   // keys any query of this block may see
    int warp_clear = kv_len;  // keys every row of this warp sees
    if (block_tokens > 0) {
        const int last_q = min(lq - 1, qb + FA_BR - 1);
        block_end = min(kv_len, (last_q / block_tokens + 1) * block_tokens);
        warp_clear = min(kv_len, ((qb + warp * 32) / block_tokens + 1) * block_tokens);
    }
    // Group 0: the Q tile with the first K/V tile.
    fa_load_rows(qs, q, qb, FA_BR, lq, row, h);
    fa_load_rows(tiles, k, 0, BC, kv_len, row, h);
    fa_load_rows(tiles + TILE, v, 0, BC, kv_len, row, h);
    wl_cp_async_commit();

    // ldmatrix row addresses: lane l serves matrix l/8, row l%8.
    const int lm = lane / 8, lr = lane % 8;
    const wl_bf16* q_row = qs + (warp * 32 + lr + (lm % 2) * 8) * FA_PAD + (lm / 2) * 8;

    float o[2][16][4];
    #pragma unroll
    for (int i = 0; i < 2; ++i)
        #pragma unroll
        for (int j = 0; j < 16; ++j) o[i][j][0] = o[i][j][1] = o[i][j][2] = o[i][j][3] = 0.0f;
    // Running max (scaled, base 2) and this lane's share of the row sums; the sums of the four
    // lanes of a row are added once at the end (they share every rescale factor).
    float m[2][2], l[2][2];
    #pragma unroll
    for (int i = 0; i < 2; ++i)
        #pragma unroll
        for (int e = 0; e < 2; ++e) m[i][e] = -WL_INF, l[i][e] = 0.0f;

    int stage = 0;
    for (int kb = 0; kb < block_end; kb += BC, stage ^= 1) {
        if (kb + BC < block_end) {
            wl_bf16* next = tiles + (stage ^ 1) * 2 * TILE;
            fa_load_rows(next, k, kb + BC, BC, kv_len, row, h);
            fa_load_rows(next + TILE, v, kb + BC, BC, kv_len, row, h);
            wl_cp_async_commit();
            wl_cp_async_wait_one();
        } else {
            wl_cp_async_wait_all();
        }
        __syncthreads();
        const wl_bf16* ks = tiles + stage * 2 * TILE;
        const wl_bf16* vs = ks + TILE;

        // S = Q Kᵀ for this warp's 32 rows × BC keys, one 16-dim step at a time; one K ldmatrix
        // gives two 8-key groups and serves both halves.
        float s[2][NJ][4];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < NJ; ++j) s[i][j][0] = s[i][j][1] = s[i][j][2] = s[i][j][3] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            unsigned int qa[2][4];
#pragma unroll
            for (int i = 0; i < 2; ++i) wl_ldmatrix_x4(qa[i], q_row + i * 16 * FA_PAD + kk * 16);
#pragma unroll
            for (int j = 0; j < NJ; j += 2) {
                unsigned int b[4];
                wl_ldmatrix_x4(b, ks + ((j + lm / 2) * 8 + lr) * FA_PAD + kk * 16 + (lm % 2) * 8);
#pragma unroll
                for (int i = 0; i < 2; ++i) {
                    wl_mma_16816(s[i][j], qa[i], b);
                    wl_mma_16816(s[i][j + 1], qa[i], b + 2);
                }
            }
        }
        // Softmax on raw scores: the max is taken before scaling (scale > 0), and one FMA per
        // score scales and subtracts it ahead of the exponential.
        const bool masked = kb + BC > warp_clear;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            float mx[2] = {-WL_INF, -WL_INF};
#pragma unroll
            for (int j = 0; j < NJ; ++j) {
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int e = c / 2;
                    if (masked) {
                        const int rq = row0 + i * 16 + e * 8;
                        const int lim = block_tokens > 0 ? min(kv_len, (rq / block_tokens + 1) * block_tokens) : kv_len;
                        if (kb + j * 8 + cq + (c & 1) >= lim) s[i][j][c] = -WL_INF;
                    }
                    mx[e] = fmaxf(mx[e], s[i][j][c]);
                }
            }
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                mx[e] = fmaxf(mx[e], wl_shfl_xor(mx[e], 1));
                mx[e] = fmaxf(mx[e], wl_shfl_xor(mx[e], 2));
                const float n = fmaxf(m[i][e], mx[e] * scale2);
                // A row with nothing visible yet keeps m = -inf; exp of (-inf) - (-inf) must not
                // be NaN.
                const float base = n == -WL_INF ? 0.0f : n;
                const float corr = wl_exp2_approx(m[i][e] - base);
                float sum = 0.0f;
#pragma unroll
                for (int j = 0; j < NJ; ++j) {
                    s[i][j][2 * e] = wl_exp2_approx(fmaf(s[i][j][2 * e], scale2, -base));
                    s[i][j][2 * e + 1] = wl_exp2_approx(fmaf(s[i][j][2 * e + 1], scale2, -base));
                    sum += s[i][j][2 * e] + s[i][j][2 * e + 1];
                }
                l[i][e] = l[i][e] * corr + sum;
                m[i][e] = n;
#pragma unroll
                for (int j = 0; j < 16; ++j) {
                    o[i][j][2 * e] *= corr;
                    o[i][j][2 * e + 1] *= corr;
                }
            }
        }
        // O += P V: the S accumulators of two adjacent key groups are the A fragment of one
        // 16-key step; one transposing ldmatrix gives the V fragments of two 8-dim groups, used
        // by both halves.
        #pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) {
            unsigned int pa[2][4];
            #pragma unroll
            for (int i = 0; i < 2; ++i) {
                pa[i][0] = wl_cvt_bf16x2(s[i][2 * kk][0], s[i][2 * kk][1]);
                pa[i][1] = wl_cvt_bf16x2(s[i][2 * kk][2], s[i][2 * kk][3]);
                pa[i][2] = wl_cvt_bf16x2(s[i][2 * kk + 1][0], s[i][2 * kk + 1][1]);
                pa[i][3] = wl_cvt_bf16x2(s[i][2 * kk + 1][2], s[i][2 * kk + 1][3]);
            }
            const wl_bf16* vrow = vs + (kk * 16 + (lm % 2) * 8 + lr) * FA_PAD + (lm / 2) * 8;
            #pragma unroll
            for (int j = 0; j < 16; j += 2) {
                unsigned int b[4];
                wl_ldmatrix_x4_trans(b, vrow + j * 8);
                #pragma unroll
                for (int i = 0; i < 2; ++i) {
                    wl_mma_16816(o[i][j], pa[i], b);
                    wl_mma_16816(o[i][j + 1], pa[i], b + 2);
                }
            }
        }
        // The stage just read is refilled two tiles on: everyone must be done with it first.
        __syncthreads();
    }
    #pragma unroll
    for (int i = 0; i < 2; ++i) {
        float inv[2];
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
            float t = l[i][e];
            t += wl_shfl_xor(t, 1);
            t += wl_shfl_xor(t, 2);
            inv[e] = 1.0f / t;
        }
        #pragma unroll
        for (int j = 0; j < 16; ++j) {
            const int c = j * 8 + cq;
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int rq = row0 + i * 16 + e * 8;
                if (rq < lq)
                    *(unsigned int*)(out + (wl_u64)rq * row + (wl_u64)h * FA_D + c) =
                        wl_cvt_bf16x2(o[i][j][2 * e] * inv[e], o[i][j][2 * e + 1] * inv[e]);
            }
        }
    }
}

#define WL_FLASH(BC)                                                                                          \
    WL_KERNEL void __launch_bounds__(32 * FA_WARPS, 2)                                                        \
        flash_attention_bf16_d128_bc##BC(wl_bf16* out, const wl_bf16* q, const wl_bf16* k, const wl_bf16* v, \
                                         int lq, int kv_len, int heads, int block_tokens, float scale) {     \
        flash_attention_d128<BC>(out, q, k, v, lq, kv_len, heads, block_tokens, scale);                       \
    }
WL_FLASH(64)
WL_FLASH(32)
#endif

#if defined(WL_HAS_MFMA_BF16)
// Attention on CDNA matrix cores (v_mfma_f32_16x16x16_bf16, wave64): bf16 q/k/v with rows
// [tokens, heads, 128], f32 accumulation and online softmax in base 2, bf16 out. A wavefront owns
// 32 queries of one head as two 16-query halves, so each K and V fragment read from LDS feeds two
// MFMAs; key tiles of up to 64 are staged in LDS, K row-major and V transposed, so that both A
// operands are one 64-bit LDS read per lane.
//
// The scores are computed transposed, Sᵀ = K·Qᵀ: in MFMA's output layout a lane holds four keys
// of one query, so every query's softmax state lives in one lane (two xor-shuffles join the four
// lane groups' maxima and sums), and the probabilities are already the B operand of
// Oᵀ = Vᵀ·Pᵀ, whose output again keeps a query per lane: no shuffles between the two products
// and the rescale needs no exchange. Q stays in registers (8 fragments per half).
// Single-buffered and not tuned: never run on an AMD GPU (checked on the CPU emulation of
// kernels/tests/rocm_emu and at every worker start on ROCm).
//
// KW, the bf16 of K a lane holds per operand: 4 for v_mfma_f32_16x16x16_bf16 (gfx90a on), 8 for
// gfx950's v_mfma_f32_16x16x32_bf16 (the `*_mfma32_*` kernels), which covers 32 keys a product
// in Oᵀ = Vᵀ·Pᵀ: a lane's probabilities are then keys 4·grp .. +3 of two 16-key score blocks,
// so V is staged with each 32-key group permuted (fm_vt_pos) to make them one 16-byte read.
#define FM_D 128
#define FM_BC 64
#define FM_KP (FM_D + 8)
#define FM_VP (FM_BC + 8)

struct FmState {
    wl_f32x4 o[2][FM_D / 16];  // Oᵀ: dims 16·j + 4·grp .. +3 of this lane's query, per half
    float m[2], l[2];          // running max (scaled, base 2) and this lane's share of the sum
};

// One lane's operand of KW bf16 and the product that takes it.
template <int KW>
struct FmFrag;
template <>
struct FmFrag<4> {
    typedef wl_bf16x4 T;
    static WL_DEVICE T ld(const wl_bf16* p) { return wl_ld_bf16x4(p); }
    static WL_DEVICE wl_f32x4 mma(T a, T b, wl_f32x4 c) { return wl_mfma_16x16x16_bf16(a, b, c); }
};
#if defined(WL_HAS_MFMA_K32)
template <>
struct FmFrag<8> {
    typedef wl_bf16x8 T;
    static WL_DEVICE T ld(const wl_bf16* p) { return wl_ld_bf16x8(p); }
    static WL_DEVICE wl_f32x4 mma(T a, T b, wl_f32x4 c) { return wl_mfma_16x16x32_bf16(a, b, c); }
};
#endif

// Where key r of a tile sits in the transposed V: within each group of 4·KW keys, key
// 16·q + 4·g + e (q < KW/4, g < 4, e < 4) at KW·g + 4·q + e, the order of lane group g's
// probabilities in the B operand (the identity for KW = 4).
template <int KW>
WL_DEVICE int fm_vt_pos(int r) {
    const int base = r & ~(4 * KW - 1), q = (r & (4 * KW - 1)) >> 4, g = (r >> 2) & 3, e = r & 3;
    return base + KW * g + 4 * q + e;
}

WL_DEVICE void fm_init(FmState& st) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        st.m[hh] = -WL_INF, st.l[hh] = 0.0f;
#pragma unroll
        for (int j = 0; j < FM_D / 16; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) st.o[hh][j][e] = 0.0f;
    }
}

// The Q fragments of a lane's two queries (tokens `tok`, zeros where not `valid`): the B operand
// of Sᵀ, dims KW·grp .. +KW-1 of every 4·KW-dim step.
template <int KW>
WL_DEVICE void fm_load_q(typename FmFrag<KW>::T (&qf)[2][FM_D / (4 * KW)], const wl_bf16* q, const int* tok,
                         const bool* valid, wl_u64 row, int h, int grp) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int kk = 0; kk < FM_D / (4 * KW); ++kk) {
            if (valid[hh]) {
                qf[hh][kk] = FmFrag<KW>::ld(q + (wl_u64)tok[hh] * row + (wl_u64)h * FM_D + kk * 4 * KW + grp * KW);
            } else {
#pragma unroll
                for (int e = 0; e < KW; ++e) qf[hh][kk][e] = 0;
            }
        }
}

// Stages `count` (≤ FM_BC) key rows, tokens first .. first+count-1 or, with `order`, the tokens
// order[first ..]; the rest of the tile is zeros (a masked key's probability is 0, and 0 · garbage
// could be NaN). V goes transposed, its keys at fm_vt_pos. The whole block takes part; the caller
// syncs after.
template <int KW>
WL_DEVICE void fm_stage(wl_bf16* ks, wl_bf16* vt, const wl_bf16* k, const wl_bf16* v, const int* order, int first,
                        int count, wl_u64 row, int h) {
    for (int i = threadIdx.x; i < FM_BC * FM_D / 8; i += blockDim.x) {
        const int r = i / (FM_D / 8), c8 = (i % (FM_D / 8)) * 8;
        uint4 kw = make_uint4(0, 0, 0, 0), vw = make_uint4(0, 0, 0, 0);
        if (r < count) {
            const int tok = order ? order[first + r] : first + r;
            const wl_u64 at = (wl_u64)tok * row + (wl_u64)h * FM_D + c8;
            kw = *(const uint4*)(k + at);
            vw = *(const uint4*)(v + at);
        }
        *(uint4*)(ks + r * FM_KP + c8) = kw;
        const unsigned int w[4] = {vw.x, vw.y, vw.z, vw.w};
#pragma unroll
        for (int e = 0; e < 8; ++e) vt[(c8 + e) * FM_VP + fm_vt_pos<KW>(r)] = (wl_bf16)(w[e / 2] >> (16 * (e % 2)));
    }
}

// One tile's online softmax per query, in the Sᵀ layout (lane (col, grp) holds keys 16·t + 4·grp
// .. +3 of query col of each half): keys at or past vis[hh] are masked, the state's O rescaled,
// and s left holding the probabilities. The max is taken on raw scores (scale2 > 0).
WL_DEVICE void fm_softmax(FmState& st, wl_f32x4 (&s)[2][FM_BC / 16], const int* vis, float scale2, int grp) {
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        float mx = -WL_INF;
#pragma unroll
        for (int t = 0; t < FM_BC / 16; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                if (t * 16 + grp * 4 + e >= vis[hh]) s[hh][t][e] = -WL_INF;
                mx = fmaxf(mx, s[hh][t][e]);
            }
        mx = fmaxf(mx, wl_shfl_xor(mx, 16));
        mx = fmaxf(mx, wl_shfl_xor(mx, 32));
        const float n = fmaxf(st.m[hh], mx * scale2);
        // A query with nothing visible yet keeps m = -inf; (-inf) - (-inf) must not be NaN.
        const float base = n == -WL_INF ? 0.0f : n;
        const float corr = exp2f(st.m[hh] - base);
        float sum = 0.0f;
#pragma unroll
        for (int t = 0; t < FM_BC / 16; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float p = exp2f(fmaf(s[hh][t][e], scale2, -base));
                s[hh][t][e] = p;
                sum += p;
            }
        // The four lane groups' shares are joined at the end: they share every rescale factor.
        st.l[hh] = st.l[hh] * corr + sum;
        st.m[hh] = n;
#pragma unroll
        for (int j = 0; j < FM_D / 16; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) st.o[hh][j][e] *= corr;
    }
}

// One staged tile into the state: keys at or past vis[hh] of the tile are masked for half hh.
template <int KW>
WL_DEVICE void fm_step(FmState& st, const wl_bf16* ks, const wl_bf16* vt,
                       const typename FmFrag<KW>::T (&qf)[2][FM_D / (4 * KW)], const int* vis, float scale2, int col,
                       int grp) {
    typedef FmFrag<KW> F;
    // Sᵀ: lane (col, grp) gets keys 16·t + 4·grp .. +3 of query col of each half.
    wl_f32x4 s[2][FM_BC / 16];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
#pragma unroll
        for (int t = 0; t < FM_BC / 16; ++t)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[hh][t][e] = 0.0f;
#pragma unroll
    for (int t = 0; t < FM_BC / 16; ++t) {
#pragma unroll
        for (int kk = 0; kk < FM_D / (4 * KW); ++kk) {
            const typename F::T a = F::ld(ks + (t * 16 + col) * FM_KP + kk * 4 * KW + grp * KW);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) s[hh][t] = F::mma(a, qf[hh][kk], s[hh][t]);
        }
    }
    fm_softmax(st, s, vis, scale2, grp);
    // Oᵀ += Vᵀ·Pᵀ, 4·KW keys a step: the probabilities of KW/4 score blocks as bf16 are the B
    // operand.
#pragma unroll
    for (int t = 0; t < FM_BC / (4 * KW); ++t) {
        typename F::T p[2];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh)
#pragma unroll
            for (int e = 0; e < KW; ++e) p[hh][e] = (short)wl_to_bf16(s[hh][t * (KW / 4) + e / 4][e % 4]);
#pragma unroll
        for (int j = 0; j < FM_D / 16; ++j) {
            const typename F::T a = F::ld(vt + (j * 16 + col) * FM_VP + t * 4 * KW + grp * KW);
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) st.o[hh][j] = F::mma(a, p[hh], st.o[hh][j]);
        }
    }
}

// 1 / the softmax sum of half hh's query (every lane of the wavefront takes part).
WL_DEVICE float fm_inv_sum(const FmState& st, int hh) {
    float t = st.l[hh];
    t += wl_shfl_xor(t, 16);
    t += wl_shfl_xor(t, 32);
    return 1.0f / t;
}

// Flash attention (the mma.sync kernel's contract): a block of 4 wavefronts takes 128 queries of
// one head; keys past `kv_len`, or past a query's chunk when `block_tokens > 0`, are masked.
#define FM_WAVES 4
#define FM_BR (32 * FM_WAVES)

template <int KW>
WL_DEVICE void flash_mfma_d128(wl_bf16* out, const wl_bf16* q, const wl_bf16* k, const wl_bf16* v, int lq,
                               int kv_len, int heads, int block_tokens, float scale) {
    __align__(16) __shared__ wl_bf16 ks[FM_BC * FM_KP];
    __align__(16) __shared__ wl_bf16 vt[FM_D * FM_VP];
    const int wave = threadIdx.x / 64, lane = threadIdx.x % 64;
    const int col = lane % 16, grp = lane / 16;
    const int h = blockIdx.y, qb = blockIdx.x * FM_BR;
    const wl_u64 row = (wl_u64)heads * FM_D;
    int qi[2], lim[2];
    bool valid[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        qi[hh] = qb + wave * 32 + hh * 16 + col;
        valid[hh] = qi[hh] < lq;
        lim[hh] = block_tokens > 0 ? min(kv_len, (qi[hh] / block_tokens + 1) * block_tokens) : kv_len;
    }
    typename FmFrag<KW>::T qf[2][FM_D / (4 * KW)];
    fm_load_q<KW>(qf, q, qi, valid, row, h, grp);
    int block_end = kv_len;
    if (block_tokens > 0) block_end = min(kv_len, (min(lq - 1, qb + FM_BR - 1) / block_tokens + 1) * block_tokens);
    FmState st;
    fm_init(st);
    for (int kb = 0; kb < block_end; kb += FM_BC) {
        fm_stage<KW>(ks, vt, k, v, nullptr, kb, min(FM_BC, kv_len - kb), row, h);
        __syncthreads();
        const int vis[2] = {lim[0] - kb, lim[1] - kb};
        fm_step<KW>(st, ks, vt, qf, vis, scale * 1.4426950408889634f, col, grp);
        // The tile is restaged next: everyone must be done reading it.
        __syncthreads();
    }
    // Lane (col, grp) holds dims 16·j + 4·grp .. +3 of its query: one 8-byte store per j.
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const float inv = fm_inv_sum(st, hh);
        if (!valid[hh]) continue;
        wl_bf16* dst = out + (wl_u64)qi[hh] * row + (wl_u64)h * FM_D + grp * 4;
#pragma unroll
        for (int j = 0; j < FM_D / 16; ++j)
            *(uint2*)(dst + j * 16) = make_uint2(wl_pack_bf16(st.o[hh][j][0] * inv, st.o[hh][j][1] * inv),
                                                 wl_pack_bf16(st.o[hh][j][2] * inv, st.o[hh][j][3] * inv));
    }
}

WL_KERNEL void __launch_bounds__(64 * FM_WAVES)
    flash_mfma_bf16_d128(wl_bf16* out, const wl_bf16* q, const wl_bf16* k, const wl_bf16* v, int lq, int kv_len,
                         int heads, int block_tokens, float scale) {
    flash_mfma_d128<4>(out, q, k, v, lq, kv_len, heads, block_tokens, scale);
}
#if defined(WL_HAS_MFMA_K32)
WL_KERNEL void __launch_bounds__(64 * FM_WAVES)
    flash_mfma32_bf16_d128(wl_bf16* out, const wl_bf16* q, const wl_bf16* k, const wl_bf16* v, int lq, int kv_len,
                           int heads, int block_tokens, float scale) {
    flash_mfma_d128<8>(out, q, k, v, lq, kv_len, heads, block_tokens, scale);
}
#endif

// VSA's fine branch (vsa.cu's portable vsa_fine, same arguments but q_offsets/q_sizes for
// q_tile): a block of 2 wavefronts takes one query tile (≤ 64 tokens, gathered through
// q_order) of one head and runs the kernel above over its top_k kept key tiles (≤ 64 tokens
// each, gathered through k_order); out = fine + gate · coarse (gate 1 when absent).
template <int KW>
WL_DEVICE void vsa_fine_mfma(wl_bf16* out, const wl_bf16* q, const wl_bf16* k, const wl_bf16* v, const wl_bf16* gate,
                             int mix, const float* coarse, const int* kept, const int* q_order,
                             const int* q_offsets, const int* q_sizes, const int* k_order, const int* k_offsets,
                             const int* k_sizes, int heads, int top_k, float scale) {
    __align__(16) __shared__ wl_bf16 ks[FM_BC * FM_KP];
    __align__(16) __shared__ wl_bf16 vt[FM_D * FM_VP];
    const int wave = threadIdx.x / 64, lane = threadIdx.x % 64;
    const int col = lane % 16, grp = lane / 16;
    const int tile = blockIdx.x, h = blockIdx.y;
    const wl_u64 row = (wl_u64)heads * FM_D;
    const int qfirst = q_offsets[tile], qn = q_sizes[tile];
    int tok[2];
    bool valid[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int slot = wave * 32 + hh * 16 + col;
        valid[hh] = slot < qn;
        tok[hh] = valid[hh] ? q_order[qfirst + slot] : 0;
    }
    typename FmFrag<KW>::T qf[2][FM_D / (4 * KW)];
    fm_load_q<KW>(qf, q, tok, valid, row, h, grp);
    FmState st;
    fm_init(st);
    const int* mine = kept + ((wl_u64)tile * heads + h) * top_k;
    for (int t = 0; t < top_k; ++t) {
        const int j = mine[t], n = k_sizes[j];
        fm_stage<KW>(ks, vt, k, v, k_order, k_offsets[j], n, row, h);
        __syncthreads();
        const int vis[2] = {n, n};
        fm_step<KW>(st, ks, vt, qf, vis, scale * 1.4426950408889634f, col, grp);
        __syncthreads();
    }
    const float* c = coarse + ((wl_u64)tile * heads + h) * FM_D + grp * 4;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const float inv = fm_inv_sum(st, hh);
        if (!valid[hh]) continue;
        const wl_u64 at = (wl_u64)tok[hh] * row + (wl_u64)h * FM_D + grp * 4;
#pragma unroll
        for (int j = 0; j < FM_D / 16; ++j) {
            float y[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                y[e] = st.o[hh][j][e] * inv + wl_vsa_coarse(mix, gate, at + j * 16 + e, c + j * 16 + e);
            }
            *(uint2*)(out + at + j * 16) = make_uint2(wl_pack_bf16(y[0], y[1]), wl_pack_bf16(y[2], y[3]));
        }
    }
}

#define WL_VSA_FINE_MFMA(name, kw)                                                                                   \
    WL_KERNEL void __launch_bounds__(128)                                                                            \
        name(wl_bf16* out, const wl_bf16* q, const wl_bf16* k, const wl_bf16* v, const wl_bf16* gate, int mix,      \
             const float* coarse, const int* kept, const int* q_order, const int* q_offsets, const int* q_sizes,     \
             const int* k_order, const int* k_offsets, const int* k_sizes, int heads, int top_k, float scale) {      \
        vsa_fine_mfma<kw>(out, q, k, v, gate, mix, coarse, kept, q_order, q_offsets, q_sizes, k_order,         \
                          k_offsets, k_sizes, heads, top_k, scale);                                                  \
    }
WL_VSA_FINE_MFMA(vsa_fine_mfma_bf16_d128, 4)
#if defined(WL_HAS_MFMA_K32)
WL_VSA_FINE_MFMA(vsa_fine_mfma32_bf16_d128, 8)
#endif
#endif

#if defined(WL_HAS_WGMMA)
// Hopper's warpgroup MMA (wgmma): a warpgroup of four warps owns 64 query rows; S = Q·Kᵀ reads
// its operands from shared memory through descriptors, and P stays in registers as the A operand
// of O += P·V. The dense kernel takes two such warpgroups per block of 128 queries, the VSA fine
// kernel one query tile per warpgroup, both fed by TMA.
#define FW_BR 128

// One tile's online-softmax step for this thread's two rows (e = 0: row0, 1: row0 + 8) of a
// 64×BC score block in the wgmma accumulator layout: masks, turns scores into probabilities in
// place, and returns each row's new max, rescale factor and partial sum (this lane's share).
// Keys kb + column at or past a row's limit are masked by a select, not a branch: the dense
// kernel runs this while a wgmma is in flight, and ptxas serialises wgmmas around branches.
// MASK = false leaves the masking out (a compare and a select per score, a seventh of the fp8
// kernel's instructions) for tiles that lie wholly below every limit of the block's rows.
// The probabilities come out times 2^log2_gain (the fp8 kernel's scaling of P into e4m3's range).
// LAZY > 0 keeps a row's running max until a tile's max passes it by more than LAZY (log2
// units): the weights then reach up to 2^LAZY, which bf16's P and the f32 sums hold with the
// same relative rounding, and the output is rescaled only on the rare tile that moves a max that
// far (FlashAttention-4's conditional rescaling). With the exact max every new maximum of any of
// a warp's 16 rows costs the warp the 64-multiply rescale, and keys that rise toward the query's
// own position (RoPE, recency) move it on tile after tile. fp8's P must stay under 448, so that
// kernel keeps the exact max (LAZY = 0).
// Bit e of `live` clear: the warp's rows e hold no query (VSA's padded tiles) and are skipped, so
// their scores stay as the product left them and their state does not move.
#define FW_LAZY 8
template <int BC, bool MASK = true, int LAZY = 0>
WL_DEVICE void fw_softmax(float* s, const float* m, float* n_out, float* corr, float* sum, int kb, int row0, int cq,
                          int kv_len, int block_tokens, float scale2,
                          float log2_gain = 0.0f, int live = 3) {
    auto row = [&](int e) {
        if constexpr (MASK) {
            const int rq = row0 + e * 8;
            const int lim = block_tokens > 0 ? min(kv_len, (rq / block_tokens + 1) * block_tokens) : kv_len;
            const int visible = lim - kb - cq;  // column j·8 + c is visible iff j·8 + c < visible
#pragma unroll
            for (int j = 0; j < BC / 8; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    float& x = s[4 * j + 2 * e + c];
                    x = j * 8 + c < visible ? x : -WL_INF;
                }
        }
        float mx = -WL_INF;
#pragma unroll
        for (int j = 0; j < BC / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * e], s[4 * j + 2 * e + 1]));
        mx = fmaxf(mx, wl_shfl_xor(mx, 1));
        mx = fmaxf(mx, wl_shfl_xor(mx, 2));
        const float cand = mx * scale2;
        const float n = LAZY > 0 ? (cand > m[e] + (float)LAZY ? cand : m[e]) : fmaxf(m[e], cand);
        // A row with nothing visible yet keeps m = -inf; exp of (-inf) - (-inf) must not be NaN.
        const float base = n == -WL_INF ? 0.0f : n;
        corr[e] = wl_exp2_approx(m[e] - base);
        const float shift = log2_gain - base;
        float t = 0.0f;
#pragma unroll
        for (int j = 0; j < BC / 8; ++j) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float p = wl_exp2_approx(fmaf(s[4 * j + 2 * e + c], scale2, shift));
                s[4 * j + 2 * e + c] = p;
                t += p;
            }
        }
        sum[e] = t;
        n_out[e] = n;
    };
    // Both rows in one block of code, so that their chains (max, shuffles, exponentials, sum)
    // interleave: row by row, each behind a branch, measured 8 % slower in VSA (H200).
    if (live == 3) {
#pragma unroll
        for (int e = 0; e < 2; ++e) row(e);
    } else {
#pragma unroll
        for (int e = 0; e < 2; ++e)
            if (live >> e & 1) row(e);
            else n_out[e] = m[e], corr[e] = 1.0f, sum[e] = 0.0f;  // rows without a query (VSA)
    }
}

// A row's softmax sum: the four lanes holding its columns each carry a share.
WL_DEVICE float fw_row_sum(float l) {
    l += wl_shfl_xor(l, 1);
    return l + wl_shfl_xor(l, 2);
}

// Applies a tile's softmax step to the running state: row sums and maxima, and the output
// accumulators (64 × 128, wgmma layout) rescaled to the new maxima.
// Once the rows have seen a few tiles their maxima rarely move (corr = 1), so a warp skips the
// 64 multiplies unless one of its rows' maxima did. The branch is safe here: the callers have
// waited for every wgmma before.
WL_DEVICE void fw_rescale(float* o, float* m, float* l, const float* n, const float* corr, const float* sum) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        l[e] = l[e] * corr[e] + sum[e];
        m[e] = n[e];
    }
    if (!wl_any(corr[0] != 1.0f || corr[1] != 1.0f)) return;
#pragma unroll
    for (int e = 0; e < 2; ++e)
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            o[4 * j + 2 * e] *= corr[e];
            o[4 * j + 2 * e + 1] *= corr[e];
        }
}

// This thread's share of 64 query rows at qs (as TMA puts them: two 64-dim halves `half` bytes
// apart, 128-byte rows with the 128-byte swizzle, the 16-byte chunk c of row r at c ^ r % 8, the
// halves 1024-byte aligned) in the A-fragment layout of wgmma: rows r0 and r0 + 8, dims
// 16·kk + cq (+1) and the same + 8.
// Rows ra and rb of the tile (r0 and r0 + 8 but for VSA's reordered query tiles) stand in the
// fragment's rows r0 and r0 + 8.
WL_DEVICE void fw_load_q_rows(unsigned int (*qa)[4], const unsigned char* qs, int half, int ra, int rb, int cq) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = r & 1 ? rb : ra, d = (kk % 4) * 16 + (r >> 1) * 8 + cq;
            const int at = kk / 4 * half + row * 128 + (((d >> 3) ^ (row & 7)) << 4) + (d & 7) * 2;
            qa[kk][r] = *(const unsigned int*)(qs + at);
        }
}
WL_DEVICE void fw_load_q(unsigned int (*qa)[4], const unsigned char* qs, int half, int r0, int cq) {
    fw_load_q_rows(qa, qs, half, r0, r0 + 8, cq);
}

// Key tiles of BC keys from this index on may reach past the limit of some row of the 128-query
// block at qb (limits grow with the row, so the block's first row has the smallest); the
// tiles before it are visible whole to every row and skip the softmax's masking.
WL_DEVICE int fw_first_masked(int qb, int kv_len, int block_tokens, int bc) {
    const int lim = block_tokens > 0 ? min(kv_len, (qb / block_tokens + 1) * block_tokens) : kv_len;
    return lim / bc;
}

// The dense kernel, in three warpgroups. The producer (warpgroup 2, one thread) copies Q and then
// K and V tiles of BC keys by TMA into `ST` stages of 128-byte-swizzled shared memory, each
// stage's arrival counted on its "full" barrier, and refills a stage once both consumers have
// arrived on its "empty" barrier. Two consumer warpgroups own 64 queries each:
//  - S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1} are issued together, and the softmax of S_j runs while
//    P·V is still on the tensor cores (O is rescaled once it is done);
//  - ping-pong: named barriers 1 and 2 order the two warpgroups' issue, so one's softmax runs
//    under the other's products instead of both waiting on the exponentials at once;
//  - V is read as stored ([keys, heads, 128]) as an N-major B operand: no transposed copy;
//  - with QR (the default build), a consumer holds its 64 queries in registers once they have
//    arrived, so S = Q·Kᵀ reads only K from shared memory: 1.3-1.7 % faster on an H100
//    (2026-12-06), as in the VSA fine kernel.
// Measured on the H200 at 4680 × 28080 × 40 heads (exp harness, SDPA 591 TFLOP/s in the same
// run): 538; the same with a transposed V 539; without ping-pong 509 (489 with Vᵀ); thread 0 of
// a consumer loading and a block-wide sync per tile 478; cp.async by every thread 277. In
// `bench kernels` (SDPA 615): 618.
#define FT_THREADS 384
// The tail split: a grid of whole (query block, head) items is a whole number of waves plus a
// last, partial one, where most SMs wait for a few blocks (at 4680 queries × 12 heads, 444 blocks
// on 132 SMs make 3.36 waves that take 4). So the grid runs its first `whole` items whole and
// the rest in `parts` key ranges each, one block per range, placed last; such a block writes its
// unnormalised output and its rows' (max, sum) to `part_o`/`part_ml` and `flash_split_combine`
// merges the ranges. With parts = 1 every item is whole.
struct fw_split {
    int whole, parts;
    float* o;   // [split items · parts, 128 rows, 128]
    float* ml;  // [split items · parts, 128 rows, 2]: the row's max (log2 units), sum
};

// A consumer's finished rows (this thread's row0 and row0 + 8): a split item's part leaves its
// output (times `oscale`) unnormalised, with the rows' (max, sum), for flash_split_combine; a
// whole item writes oscale · o / sum as bf16.
WL_DEVICE void fw_finish(const float* o, const float* m, const float* l, float oscale, wl_bf16* out,
                         const fw_split& sp, int item, int part, int qb, int row0, int cq, int lq, int heads, int h) {
    if (part >= 0) {
        const wl_u64 slot = (wl_u64)(item - sp.whole) * sp.parts + part;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float tl = fw_row_sum(l[e]);
            const int r = row0 - qb + e * 8;
            float* po = sp.o + (slot * FW_BR + r) * 128;
#pragma unroll
            for (int j = 0; j < 16; ++j)
                *(float2*)(po + j * 8 + cq) = make_float2(o[4 * j + 2 * e] * oscale, o[4 * j + 2 * e + 1] * oscale);
            if (cq == 0) *(float2*)(sp.ml + (slot * FW_BR + r) * 2) = make_float2(m[e], tl);
        }
        return;
    }
    const wl_u64 row = (wl_u64)heads * 128;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const float inv = oscale / fw_row_sum(l[e]);
        const int rq = row0 + e * 8;
        if (rq < lq) {
#pragma unroll
            for (int j = 0; j < 16; ++j)
                *(unsigned int*)(out + (wl_u64)rq * row + (wl_u64)h * 128 + j * 8 + cq) =
                    wl_cvt_bf16x2(o[4 * j + 2 * e] * inv, o[4 * j + 2 * e + 1] * inv);
        }
    }
}

// PERSIST (with QR): a block per SM walks the items blockIdx.x, + gridDim.x, … (all whole), the
// producer loading the next item's queries and first tiles while the consumers finish this one,
// so an item's start and end no longer leave the tensor cores idle: for the text
// cross-attention's items of four key tiles they weigh as much as the tiles. Only PERSIST has
// the item loops (one per role); the one-item kernels keep their measured straight-line code,
// which a shared loop cost ~180 instructions (2026-12-06).
template <int BC, int ST, bool QR, bool PERSIST>
WL_DEVICE void flash_tma_d128(wl_bf16* out, const wl_tmap* tq, const wl_tmap* tk, const wl_tmap* tv, int lq,
                              int kv_len, int heads, int block_tokens, float scale, fw_split sp) {
    static_assert(!QR || BC == 128, "queries in registers: 128-key tiles only");
    static_assert(!PERSIST || QR, "a persistent block frees its queries' memory once they are in registers");
    constexpr int KB = BC * 256, SB = 2 * KB;  // bytes of a K (or V) tile, of a stage
    extern __shared__ __align__(1024) unsigned char ft_smem[];
    unsigned char* qs = ft_smem;                      // dims 0-63 | 64-127, 128 rows each
    unsigned char* stages = ft_smem + FW_BR * 256;    // ST × (K | V), each as two 64-dim halves
    // K and V have barriers of their own: a K tile is free once its scores are computed, a V
    // tile only after the next tile's P·V, so K can be refilled a step before V is.
    unsigned long long* full = (unsigned long long*)(stages + ST * SB);  // K: [0, ST), V: [ST, 2·ST)
    unsigned long long* empty = full + 2 * ST;
    unsigned long long* qbar = empty + 2 * ST;
    unsigned long long* qfree = qbar + 1;  // PERSIST: every consumer thread has its queries
    // The warpgroup index through a shuffle, so the compiler keeps what derives from it uniform
    // (see vsa_fine_tma).
    const int wg = wl_shfl((int)(threadIdx.x / 128), 0), t = threadIdx.x % 128, lane = t % 32;
    const int nqb = (lq + FW_BR - 1) / FW_BR;
    const int items = nqb * heads;
    // An item's head, first query, and key tiles j0 + [0, n) (the host makes every part at least
    // one tile).
    struct work {
        int item, part, h, qb, j0, n;
    };
    auto at = [&](int it) {
        work w;
        w.item = it, w.part = -1;
        if (it >= sp.whole) w.part = (it - sp.whole) % sp.parts, w.item = sp.whole + (it - sp.whole) / sp.parts;
        w.h = w.item / nqb, w.qb = w.item % nqb * FW_BR;
        int block_end = kv_len;
        if (block_tokens > 0)
            block_end = min(kv_len, (min(lq - 1, w.qb + FW_BR - 1) / block_tokens + 1) * block_tokens);
        const int tiles = (block_end + BC - 1) / BC;
        w.j0 = w.part < 0 ? 0 : w.part * tiles / sp.parts;
        w.n = w.part < 0 ? tiles : (w.part + 1) * tiles / sp.parts - w.j0;
        return w;
    };
    const work w0 = at(blockIdx.x);
    if (threadIdx.x == 0) {
        for (int s = 0; s < 2 * ST; ++s) wl_mbar_init(full + s, 1), wl_mbar_init(empty + s, 2);
        wl_mbar_init(qbar, 1);
        wl_mbar_init(qfree, 256);
        wl_mbar_init_fence();
    }
    __syncthreads();
    if (wg == 2) {
        // 40 registers for the producer leave 232 for each consumer thread.
        WL_SETMAXNREG_DEC(40);
        // Item qi of this block, its tiles the block's g-th on: tile g + j sits in stage
        // (g + j) % ST.
        auto load = [&](const work& w, int qi, int g) {
            if (qi > 0) wl_mbar_wait(qfree, (qi - 1) & 1);
            wl_mbar_expect_tx(qbar, FW_BR * 256);
            wl_tma_load_3d(qs, tq, 0, w.h, w.qb, qbar);
            wl_tma_load_3d(qs + FW_BR * 128, tq, 64, w.h, w.qb, qbar);
            for (int j = 0; j < w.n; ++j) {
                const int u = g + j, s = u % ST, key = (w.j0 + j) * BC;
                unsigned char* ks = stages + s * SB;
                if (u >= ST) wl_mbar_wait(empty + s, (u / ST - 1) & 1);
                wl_mbar_expect_tx(full + s, KB);
                wl_tma_load_3d(ks, tk, 0, w.h, key, full + s);
                wl_tma_load_3d(ks + BC * 128, tk, 64, w.h, key, full + s);
                if (u >= ST) wl_mbar_wait(empty + ST + s, (u / ST - 1) & 1);
                wl_mbar_expect_tx(full + ST + s, KB);
                wl_tma_load_3d(ks + KB, tv, 0, w.h, key, full + ST + s);
                wl_tma_load_3d(ks + KB + BC * 128, tv, 64, w.h, key, full + ST + s);
            }
        };
        if (t == 0) {
            if constexpr (PERSIST) {
                for (int it = blockIdx.x, qi = 0, g = 0; it < items; it += gridDim.x, ++qi) {
                    const work w = at(it);
                    load(w, qi, g);
                    g += w.n;
                }
            } else {
                load(w0, 0, 0);
            }
        }
        return;
    }
    WL_SETMAXNREG_INC(232);
    const int cq = (lane % 4) * 2;
    const float scale2 = scale * 1.4426950408889634f;
    // Descriptors of this warpgroup's Q rows (in each half) and of stage 0's K and V; the
    // others are fixed offsets from these.
    const unsigned long long dq = wl_wgmma_desc_sw128(qs + wg * 64 * 128);
    const unsigned long long dk0 = wl_wgmma_desc_sw128(stages);
    const unsigned long long dv0 = wl_wgmma_desc_sw128_mn(stages + KB, BC * 128);
    // With QR the warpgroup's 64 query rows sit in registers once they have arrived, and
    // S = Q·Kᵀ reads only K from shared memory.
    unsigned int qa[QR ? 8 : 1][4];
    auto scores = [&](float* sc, int s) {
        const unsigned long long dk = wl_desc_plus(dk0, s * SB);
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const int half = kk / 4, step = (kk % 4) * 32;
            const unsigned long long da = wl_desc_plus(dq, half * FW_BR * 128 + step);
            const unsigned long long db = wl_desc_plus(dk, half * BC * 128 + step);
            if constexpr (QR) wl_wgmma_64x128x16_rs_p(sc, qa[kk], db, kk);
            else if constexpr (BC == 64) wl_wgmma_64x64x16_ss(sc, da, db, kk);
            else if constexpr (BC == 176) wl_wgmma_64x176x16_ss(sc, da, db, kk);
            else wl_wgmma_64x128x16_ss(sc, da, db, kk);
        }
    };
    auto pv = [&](float* o, const unsigned int (*pa)[4], int s) {
        const unsigned long long dv = wl_desc_plus(dv0, s * SB);
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk) wl_wgmma_64x128x16_rs_nmajor(o, pa[kk], wl_desc_plus(dv, kk * 2048));
    };
    auto pack = [](unsigned int (*pa)[4], const float* sc) {
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) pa[kk][r] = wl_cvt_bf16x2(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
    };
    // Item qi of this block, its tiles the block's g-th on (as the producer's load).
    auto run = [&](const work& w, int qi, int g) {
        const int row0 = w.qb + wg * 64 + (t / 32) * 16 + lane / 4;  // and row0 + 8
        float o[64];
#pragma unroll
        for (int j = 0; j < 64; ++j) o[j] = 0.0f;
        float m[2] = {-WL_INF, -WL_INF}, l[2] = {0.0f, 0.0f};
        unsigned int pa[BC / 16][4];
        wl_mbar_wait(qbar, qi & 1);
        if constexpr (QR) fw_load_q(qa, qs, FW_BR * 128, wg * 64 + (t / 32) * 16 + lane / 4, cq);
        if constexpr (PERSIST) wl_mbar_arrive(qfree);
        wl_mbar_wait(full + g % ST, (g / ST) & 1);
        // Warpgroup 0 issues first; each arrival on the other's barrier hands the turn over.
        if (wg == 1) wl_named_arrive(1, 256);
        {
            float sc[BC / 2];
            wl_named_sync(1 + wg, 256);
            wl_wgmma_fence();
            scores(sc, g % ST);
            wl_wgmma_commit();
            wl_named_arrive(2 - wg, 256);
            wl_wgmma_wait_all();
            if (t == 0) wl_mbar_arrive(empty + g % ST);
            float nm[2], corr[2], sum[2];
            fw_softmax<BC, true, FW_LAZY>(sc, m, nm, corr, sum, w.j0 * BC, row0, cq, kv_len, block_tokens, scale2);
#pragma unroll
            for (int e = 0; e < 2; ++e) m[e] = nm[e], l[e] = sum[e];
            pack(pa, sc);
        }
        auto step = [&](int j, bool mask) {
            const int s = (g + j) % ST, prev = (g + j - 1) % ST;
            wl_mbar_wait(full + s, ((g + j) / ST) & 1);
            wl_mbar_wait(full + ST + prev, ((g + j - 1) / ST) & 1);
            float sc[BC / 2];
            wl_named_sync(1 + wg, 256);
            wl_wgmma_fence();
            scores(sc, s);
            wl_wgmma_commit();
            pv(o, pa, prev);
            wl_wgmma_commit();
            wl_named_arrive(2 - wg, 256);
            wl_wgmma_wait_one();
            if (t == 0) wl_mbar_arrive(empty + s);
            float nm[2], corr[2], sum[2];
            // A constant once the body is inlined into its two loops: no branch is left here.
            const int kb = (w.j0 + j) * BC;
            if (mask) fw_softmax<BC, true, FW_LAZY>(sc, m, nm, corr, sum, kb, row0, cq, kv_len, block_tokens, scale2);
            else fw_softmax<BC, false, FW_LAZY>(sc, m, nm, corr, sum, kb, row0, cq, kv_len, block_tokens, scale2);
            wl_wgmma_wait_all();
            if (t == 0) wl_mbar_arrive(empty + ST + prev);
            fw_rescale(o, m, l, nm, corr, sum);
            pack(pa, sc);
        };
        const int jm = max(1, min(w.n, fw_first_masked(w.qb, kv_len, block_tokens, BC) - w.j0));
        for (int j = 1; j < jm; ++j) step(j, false);
        for (int j = jm; j < w.n; ++j) step(j, true);
        // Warpgroup 1 arrived on barrier 1 once more than warpgroup 0 waited there.
        if (wg == 0) wl_named_sync(1, 256);
        const int last = (g + w.n - 1) % ST;
        wl_mbar_wait(full + ST + last, ((g + w.n - 1) / ST) & 1);
        wl_wgmma_fence();
        pv(o, pa, last);
        wl_wgmma_commit();
        wl_wgmma_wait_all();
        // The last V stage is refilled only by a next item.
        if (PERSIST && t == 0) wl_mbar_arrive(empty + ST + last);
        fw_finish(o, m, l, 1.0f, out, sp, w.item, w.part, w.qb, row0, cq, lq, heads, w.h);
    };
    if constexpr (PERSIST) {
        for (int it = blockIdx.x, qi = 0, g = 0; it < items; it += gridDim.x, ++qi) {
            const work w = at(it);
            run(w, qi, g);
            g += w.n;
        }
    } else {
        run(w0, 0, 0);
    }
}

// q, k and v as [L, heads, 128], in boxes of 64 dims × 1 head × (128 queries | BC keys).
#define WL_FLASH_TMA(BC, ST, QR, PERSIST, suffix)                                                               \
    WL_KERNEL void __launch_bounds__(FT_THREADS, 1) flash_tma_bf16_d128_bc##BC##_s##ST##suffix(                 \
        wl_bf16* out, const __grid_constant__ wl_tmap tq, const __grid_constant__ wl_tmap tk,                  \
        const __grid_constant__ wl_tmap tv, int lq, int kv_len, int heads, int block_tokens, float scale,      \
        fw_split sp) {                                                                                          \
        flash_tma_d128<BC, ST, QR, PERSIST>(out, &tq, &tk, &tv, lq, kv_len, heads, block_tokens, scale, sp);    \
    }
// Shared memory: 32 KiB of Q, then ST stages of 2·BC·256 bytes (the H200 gives a block 227 KiB).
WL_FLASH_TMA(128, 3, false, false, )
WL_FLASH_TMA(176, 2, false, false, )
WL_FLASH_TMA(128, 3, true, false, _qr)
WL_FLASH_TMA(128, 3, true, true, _qr_persist)

// Merges the key ranges of the split items (see fw_split): a block per (split item, row), a
// thread per dim; out as the whole kernel writes it.
WL_KERNEL void flash_split_combine(wl_bf16* out, fw_split sp, int lq, int heads) {
    const int nqb = (lq + FW_BR - 1) / FW_BR;
    const int s = blockIdx.x / FW_BR, r = blockIdx.x % FW_BR, d = threadIdx.x;
    const int item = sp.whole + s, h = item / nqb, q = item % nqb * FW_BR + r;
    if (q >= lq) return;
    const wl_u64 base = (wl_u64)s * sp.parts * FW_BR + r;  // part p's row: base + p · FW_BR
    float mx = -WL_INF;
    for (int p = 0; p < sp.parts; ++p) mx = fmaxf(mx, sp.ml[(base + (wl_u64)p * FW_BR) * 2]);
    float num = 0.0f, den = 0.0f;
    for (int p = 0; p < sp.parts; ++p) {
        const wl_u64 pr = base + (wl_u64)p * FW_BR;
        const float w = wl_exp2_approx(sp.ml[pr * 2] - mx);
        num = fmaf(w, sp.o[pr * 128 + d], num);
        den = fmaf(w, sp.ml[pr * 2 + 1], den);
    }
    wl_st(out, (wl_u64)q * heads * 128 + (wl_u64)h * 128 + d, num / den);
}
#endif
