// Attention over a KV cache, correctness first: one warp per (query, head), keys in groups of a
// warp (each lane scores one key), online softmax in f32, each lane accumulating the output dims
// lane, lane + W, … The tiled tensor-core kernel replaces this for speed; this one is the GPU
// reference it will be checked against.

#define WL_ATT_MAX_D 512
#define WL_ATT_WARPS 4

template <typename T>
WL_DEVICE void attention(T* out, const T* q, const T* k, const T* v, int lq, int kv_len, int heads, int d,
                         int block_tokens, float scale) {
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
        attention(out, q, k, v, lq, kv_len, heads, d, block_tokens, scale);                                \
    }

WL_ATT(float, f32)
WL_ATT(wl_bf16, bf16)

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

// V for the VSA fine kernel: key tile j's tokens (through the tiling's index arrays) at
// columns j·64 .. j·64 + size_j of [heads, 128, tiles·64], zeros in the rest of each 64-slot block.
WL_KERNEL void vsa_v_transpose_bf16(wl_bf16* out, const wl_bf16* v, const int* order, const int* offsets,
                                    const int* sizes, int heads, int stride) {
    __shared__ wl_bf16 t[32][33];
    const int p0 = blockIdx.x * 32, c0 = blockIdx.y * 32;
    const int tx = threadIdx.x % 32, ty = threadIdx.x / 32;
    for (int r = ty; r < 32; r += blockDim.x / 32) {
        const int p = p0 + r, j = p / 64, slot = p % 64;
        t[r][tx] = slot < sizes[j] ? v[(wl_u64)order[offsets[j] + slot] * heads * 128 + c0 + tx] : (wl_bf16)0;
    }
    __syncthreads();
    for (int r = ty; r < 32; r += blockDim.x / 32) out[(wl_u64)(c0 + r) * stride + p0 + tx] = t[tx][r];
}

#if defined(WL_HAS_WGMMA)
// Hopper's warpgroup MMA (wgmma): a warpgroup of four warps owns 64 query rows; S = Q·Kᵀ reads
// its operands from shared memory through descriptors, and P stays in registers as the A operand
// of O += P·V. The dense kernel takes two such warpgroups per block of 128 queries, fed by TMA
// (flash_tma_d128). The VSA fine kernel gathers rows with cp.async into 8×8 core matrices (see
// vendor/cuda.h), each 16-byte chunk at index i = ((r / 8)·(C / 8) + c / 8)·8 + r % 8 of an R×C
// tile, and reads V from a transposed copy (vsa_v_transpose_bf16).
#define FW_BR 128

// Copies rows [first, first + rows) × 128 dims of one head into core-matrix order; rows at or
// past `limit` become zeros.
WL_DEVICE void fw_load_rows(wl_bf16* dst, const wl_bf16* src, int first, int rows, int limit, wl_u64 row, int h) {
    for (int i = threadIdx.x; i < rows * 16; i += blockDim.x) {
        const int r = (i / 128) * 8 + i % 8, c8 = (i / 8) % 16;
        const bool valid = first + r < limit;
        const wl_u64 at = (wl_u64)(valid ? first + r : 0) * row + (wl_u64)h * 128 + c8 * 8;
        wl_cp_async16(dst + i * 8, src + at, valid);
    }
}

// Copies the transposed V's 128 dims × keys [first, first + BC) of one head (always in bounds:
// the transposed copy is padded to a whole number of tiles).
template <int BC>
WL_DEVICE void fw_load_vt(wl_bf16* dst, const wl_bf16* vt, int first, int stride, int h) {
    for (int i = threadIdx.x; i < 128 * BC / 8; i += blockDim.x) {
        const int r = (i / BC) * 8 + i % 8, c8 = (i / 8) % (BC / 8);
        wl_cp_async16(dst + i * 8, vt + (wl_u64)(h * 128 + r) * stride + first + c8 * 8, true);
    }
}

// One tile's online-softmax step for this thread's two rows (e = 0: row0, 1: row0 + 8) of a
// 64×BC score block in the wgmma accumulator layout: masks, turns scores into probabilities in
// place, and returns each row's new max, rescale factor and partial sum (this lane's share).
// Keys kb + column at or past a row's limit are masked by a select, not a branch: the dense
// kernel runs this while a wgmma is in flight, and ptxas serialises wgmmas around branches.
template <int BC>
WL_DEVICE void fw_softmax(float* s, const float* m, float* n_out, float* corr, float* sum, int kb, int row0, int cq,
                          int kv_len, int block_tokens, float scale2) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
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
        float mx = -WL_INF;
#pragma unroll
        for (int j = 0; j < BC / 8; ++j) mx = fmaxf(mx, fmaxf(s[4 * j + 2 * e], s[4 * j + 2 * e + 1]));
        mx = fmaxf(mx, wl_shfl_xor(mx, 1));
        mx = fmaxf(mx, wl_shfl_xor(mx, 2));
        const float n = fmaxf(m[e], mx * scale2);
        // A row with nothing visible yet keeps m = -inf; exp of (-inf) - (-inf) must not be NaN.
        const float base = n == -WL_INF ? 0.0f : n;
        corr[e] = wl_exp2_approx(m[e] - base);
        float t = 0.0f;
#pragma unroll
        for (int j = 0; j < BC / 8; ++j) {
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const float p = wl_exp2_approx(fmaf(s[4 * j + 2 * e + c], scale2, -base));
                s[4 * j + 2 * e + c] = p;
                t += p;
            }
        }
        sum[e] = t;
        n_out[e] = n;
    }
}

// Applies a tile's softmax step to the running state: row sums and maxima, and the output
// accumulators (64 × 128, wgmma layout) rescaled to the new maxima.
WL_DEVICE void fw_rescale(float* o, float* m, float* l, const float* n, const float* corr, const float* sum) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        l[e] = l[e] * corr[e] + sum[e];
        m[e] = n[e];
#pragma unroll
        for (int j = 0; j < 16; ++j) {
            o[4 * j + 2 * e] *= corr[e];
            o[4 * j + 2 * e + 1] *= corr[e];
        }
    }
}

// The dense kernel, in three warpgroups. The producer (warpgroup 2, one thread) copies Q and then
// K and V tiles of BC keys by TMA into `ST` stages of 128-byte-swizzled shared memory, each
// stage's arrival counted on its "full" barrier, and refills a stage once both consumers have
// arrived on its "empty" barrier. Two consumer warpgroups own 64 queries each:
//  - S_j = Q·K_jᵀ and O += P_{j-1}·V_{j-1} are issued together, and the softmax of S_j runs while
//    P·V is still on the tensor cores (O is rescaled once it is done);
//  - ping-pong: named barriers 1 and 2 order the two warpgroups' issue, so one's softmax runs
//    under the other's products instead of both waiting on the exponentials at once;
//  - V is read as stored ([keys, heads, 128]) as an N-major B operand: no transposed copy.
// Measured on the H200 at 4680 × 28080 × 40 heads (exp harness, SDPA 591 TFLOP/s in the same
// run): 538; the same with a transposed V 539; without ping-pong 509 (489 with Vᵀ); thread 0 of
// a consumer loading and a block-wide sync per tile 478; cp.async by every thread 277. In
// `bench kernels` (SDPA 615): 618.
#define FT_THREADS 384
template <int BC, int ST>
WL_DEVICE void flash_tma_d128(wl_bf16* out, const wl_tmap* tq, const wl_tmap* tk, const wl_tmap* tv, int lq,
                              int kv_len, int heads, int block_tokens, float scale) {
    constexpr int KB = BC * 256, SB = 2 * KB;  // bytes of a K (or V) tile, of a stage
    extern __shared__ __align__(1024) unsigned char ft_smem[];
    unsigned char* qs = ft_smem;                      // dims 0-63 | 64-127, 128 rows each
    unsigned char* stages = ft_smem + FW_BR * 256;    // ST × (K | V), each as two 64-dim halves
    unsigned long long* full = (unsigned long long*)(stages + ST * SB);
    unsigned long long* empty = full + ST;
    unsigned long long* qbar = empty + ST;
    const int wg = threadIdx.x / 128, t = threadIdx.x % 128, lane = t % 32;
    const int h = blockIdx.y, qb = blockIdx.x * FW_BR;
    const wl_u64 row = (wl_u64)heads * 128;
    int block_end = kv_len;
    if (block_tokens > 0) block_end = min(kv_len, (min(lq - 1, qb + FW_BR - 1) / block_tokens + 1) * block_tokens);
    const int n = (block_end + BC - 1) / BC;
    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; ++s) wl_mbar_init(full + s, 1), wl_mbar_init(empty + s, 2);
        wl_mbar_init(qbar, 1);
        wl_mbar_init_fence();
    }
    __syncthreads();
    if (wg == 2) {
        // 40 registers for the producer leave 232 for each consumer thread.
        WL_SETMAXNREG_DEC(40);
        if (t == 0) {
            wl_mbar_expect_tx(qbar, FW_BR * 256);
            wl_tma_load_3d(qs, tq, 0, h, qb, qbar);
            wl_tma_load_3d(qs + FW_BR * 128, tq, 64, h, qb, qbar);
            for (int j = 0; j < n; ++j) {
                const int s = j % ST;
                if (j >= ST) wl_mbar_wait(empty + s, (j / ST - 1) & 1);
                unsigned char* ks = stages + s * SB;
                wl_mbar_expect_tx(full + s, SB);
                wl_tma_load_3d(ks, tk, 0, h, j * BC, full + s);
                wl_tma_load_3d(ks + BC * 128, tk, 64, h, j * BC, full + s);
                wl_tma_load_3d(ks + KB, tv, 0, h, j * BC, full + s);
                wl_tma_load_3d(ks + KB + BC * 128, tv, 64, h, j * BC, full + s);
            }
        }
        return;
    }
    WL_SETMAXNREG_INC(232);
    const int row0 = qb + wg * 64 + (t / 32) * 16 + lane / 4;  // and row0 + 8
    const int cq = (lane % 4) * 2;
    const float scale2 = scale * 1.4426950408889634f;
    const unsigned char* qw = qs + wg * 64 * 128;  // this warpgroup's rows in each half
    auto scores = [&](float* sc, const unsigned char* ks) {
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const int half = kk / 4, step = (kk % 4) * 32;
            const unsigned long long da = wl_wgmma_desc_sw128(qw + half * FW_BR * 128 + step);
            const unsigned long long db = wl_wgmma_desc_sw128(ks + half * BC * 128 + step);
            if constexpr (BC == 64) wl_wgmma_64x64x16_ss(sc, da, db, kk);
            else wl_wgmma_64x128x16_ss(sc, da, db, kk);
        }
    };
    auto pv = [&](float* o, const unsigned int (*pa)[4], const unsigned char* vs) {
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
            wl_wgmma_64x128x16_rs_nmajor(o, pa[kk], wl_wgmma_desc_sw128_mn(vs + kk * 2048, BC * 128));
    };
    auto pack = [](unsigned int (*pa)[4], const float* sc) {
#pragma unroll
        for (int kk = 0; kk < BC / 16; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) pa[kk][r] = wl_cvt_bf16x2(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
    };
    float o[64];
#pragma unroll
    for (int j = 0; j < 64; ++j) o[j] = 0.0f;
    float m[2] = {-WL_INF, -WL_INF}, l[2] = {0.0f, 0.0f};
    unsigned int pa[BC / 16][4];
    wl_mbar_wait(qbar, 0);
    wl_mbar_wait(full, 0);
    // Warpgroup 0 issues first; each arrival on the other's barrier hands the turn over.
    if (wg == 1) wl_named_arrive(1, 256);
    {
        float sc[BC / 2];
        wl_named_sync(1 + wg, 256);
        wl_wgmma_fence();
        scores(sc, stages);
        wl_wgmma_commit();
        wl_named_arrive(2 - wg, 256);
        wl_wgmma_wait_all();
        float nm[2], corr[2], sum[2];
        fw_softmax<BC>(sc, m, nm, corr, sum, 0, row0, cq, kv_len, block_tokens, scale2);
#pragma unroll
        for (int e = 0; e < 2; ++e) m[e] = nm[e], l[e] = sum[e];
        pack(pa, sc);
    }
    for (int j = 1; j < n; ++j) {
        const int s = j % ST, prev = (j - 1) % ST;
        wl_mbar_wait(full + s, (j / ST) & 1);
        float sc[BC / 2];
        wl_named_sync(1 + wg, 256);
        wl_wgmma_fence();
        scores(sc, stages + s * SB);
        wl_wgmma_commit();
        pv(o, pa, stages + prev * SB + KB);
        wl_wgmma_commit();
        wl_named_arrive(2 - wg, 256);
        wl_wgmma_wait_one();
        float nm[2], corr[2], sum[2];
        fw_softmax<BC>(sc, m, nm, corr, sum, j * BC, row0, cq, kv_len, block_tokens, scale2);
        wl_wgmma_wait_all();
        if (t == 0) wl_mbar_arrive(empty + prev);
        fw_rescale(o, m, l, nm, corr, sum);
        pack(pa, sc);
    }
    // Warpgroup 1 arrived on barrier 1 once more than warpgroup 0 waited there.
    if (wg == 0) wl_named_sync(1, 256);
    wl_wgmma_fence();
    pv(o, pa, stages + ((n - 1) % ST) * SB + KB);
    wl_wgmma_commit();
    wl_wgmma_wait_all();
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        float tl = l[e];
        tl += wl_shfl_xor(tl, 1);
        tl += wl_shfl_xor(tl, 2);
        const float inv = 1.0f / tl;
        const int rq = row0 + e * 8;
        if (rq < lq) {
#pragma unroll
            for (int j = 0; j < 16; ++j)
                *(unsigned int*)(out + (wl_u64)rq * row + (wl_u64)h * 128 + j * 8 + cq) =
                    wl_cvt_bf16x2(o[4 * j + 2 * e] * inv, o[4 * j + 2 * e + 1] * inv);
        }
    }
}

// ---- The fine branch of VSA (kernels/src/vsa.rs) on wgmma: one warpgroup per (query tile,
// head) attends its ≤ 64 tokens to the tokens of its `top_k` kept key tiles, one 64-slot key
// tile per step, then adds gate · coarse. Tokens are gathered through the tiling's index arrays
// as they are copied to shared memory; V comes from vsa_v_transpose_bf16, one 64-slot column
// block per key tile. Two stages, two blocks per SM.
WL_DEVICE void fw_load_gather(wl_bf16* dst, const wl_bf16* src, const int* order, int first, int n, wl_u64 row, int h) {
    for (int i = threadIdx.x; i < 64 * 16; i += blockDim.x) {
        const int r = (i / 128) * 8 + i % 8, c8 = (i / 8) % 16;
        const bool valid = r < n;
        const wl_u64 at = (wl_u64)(valid ? order[first + r] : 0) * row + (wl_u64)h * 128 + c8 * 8;
        wl_cp_async16(dst + i * 8, src + at, valid);
    }
}

WL_DEVICE void vsa_fine_wgmma(wl_bf16* out, const wl_bf16* q, const wl_bf16* k, const wl_bf16* vt,
                              const wl_bf16* gate, int has_gate, const float* coarse, const int* kept,
                              const int* q_order, const int* q_offsets, const int* q_sizes, const int* k_order,
                              const int* k_offsets, const int* k_sizes, int heads, int top_k, int vt_stride,
                              float scale) {
    constexpr int TILE = 64 * 128;
    extern __shared__ __align__(128) unsigned char fw_smem[];
    wl_bf16* qs = (wl_bf16*)fw_smem;
    wl_bf16* tiles = qs + TILE;  // [stage][K|Vᵀ][TILE]
    const int i = blockIdx.x, h = blockIdx.y;
    const int t = threadIdx.x, lane = t % 32;
    const int r0 = (t / 32) * 16 + lane / 4;  // this thread's rows r0, r0 + 8 of the query tile
    const int cq = (lane % 4) * 2;
    const float scale2 = scale * 1.4426950408889634f;
    const wl_u64 row = (wl_u64)heads * 128;
    const int qn = q_sizes[i], q0 = q_offsets[i];
    const int* mine = kept + ((wl_u64)i * heads + h) * top_k;

    fw_load_gather(qs, q, q_order, q0, qn, row, h);
    {
        const int j = mine[0];
        fw_load_gather(tiles, k, k_order, k_offsets[j], k_sizes[j], row, h);
        fw_load_vt<64>(tiles + TILE, vt, j * 64, vt_stride, h);
    }
    wl_cp_async_commit();

    float o[64];
#pragma unroll
    for (int e = 0; e < 64; ++e) o[e] = 0.0f;
    float m[2] = {-WL_INF, -WL_INF}, l[2] = {0.0f, 0.0f};
    int stage = 0;
    for (int u = 0; u < top_k; ++u, stage ^= 1) {
        if (u + 1 < top_k) {
            const int j = mine[u + 1];
            wl_bf16* next = tiles + (stage ^ 1) * 2 * TILE;
            fw_load_gather(next, k, k_order, k_offsets[j], k_sizes[j], row, h);
            fw_load_vt<64>(next + TILE, vt, j * 64, vt_stride, h);
            wl_cp_async_commit();
            wl_cp_async_wait_one();
        } else {
            wl_cp_async_wait_all();
        }
        __syncthreads();
        wl_fence_proxy_async();
        const wl_bf16* ks = tiles + stage * 2 * TILE;
        const wl_bf16* vs = ks + TILE;
        const int kn = k_sizes[mine[u]];

        float sc[32];
        wl_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk)
            wl_wgmma_64x64x16_ss(sc, wl_wgmma_desc(qs + kk * 128, 128, 2048), wl_wgmma_desc(ks + kk * 128, 128, 2048),
                                 kk);
        wl_wgmma_commit();
        wl_wgmma_wait_all();
        float n[2], corr[2], sum[2];
        // Slots at or past the tile's size are masked (kv_len = kn, no chunk mask).
        fw_softmax<64>(sc, m, n, corr, sum, 0, r0, cq, kn, 0, scale2);
        fw_rescale(o, m, l, n, corr, sum);
        unsigned int pa[4][4];
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) pa[kk][r] = wl_cvt_bf16x2(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
        wl_wgmma_fence();
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wl_wgmma_64x128x16_rs(o, pa[kk], wl_wgmma_desc(vs + kk * 128, 128, 64 * 16));
        wl_wgmma_commit();
        wl_wgmma_wait_all();
        __syncthreads();
    }
    const float* c = coarse + ((wl_u64)i * heads + h) * 128;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        float tl = l[e];
        tl += wl_shfl_xor(tl, 1);
        tl += wl_shfl_xor(tl, 2);
        const float inv = 1.0f / tl;
        const int r = r0 + e * 8;
        if (r < qn) {
            const wl_u64 base = (wl_u64)q_order[q0 + r] * row + (wl_u64)h * 128;
#pragma unroll
            for (int jj = 0; jj < 16; ++jj) {
                const int dim = jj * 8 + cq;
                const float g0 = has_gate ? wl_ld(gate, base + dim) : 1.0f;
                const float g1 = has_gate ? wl_ld(gate, base + dim + 1) : 1.0f;
                *(unsigned int*)(out + base + dim) =
                    wl_cvt_bf16x2(o[4 * jj + 2 * e] * inv + g0 * c[dim], o[4 * jj + 2 * e + 1] * inv + g1 * c[dim + 1]);
            }
        }
    }
}

WL_KERNEL void __launch_bounds__(128, 2)
    vsa_fine_wgmma_bf16_d128(wl_bf16* out, const wl_bf16* q, const wl_bf16* k, const wl_bf16* vt, const wl_bf16* gate,
                             int has_gate, const float* coarse, const int* kept, const int* q_order,
                             const int* q_offsets, const int* q_sizes, const int* k_order, const int* k_offsets,
                             const int* k_sizes, int heads, int top_k, int vt_stride, float scale) {
    vsa_fine_wgmma(out, q, k, vt, gate, has_gate, coarse, kept, q_order, q_offsets, q_sizes, k_order, k_offsets,
                   k_sizes, heads, top_k, vt_stride, scale);
}

// q, k and v as [L, heads, 128], in boxes of 64 dims × 1 head × (128 queries | BC keys).
#define WL_FLASH_TMA(BC, ST)                                                                                    \
    WL_KERNEL void __launch_bounds__(FT_THREADS, 1) flash_tma_bf16_d128_bc##BC##_s##ST(                         \
        wl_bf16* out, const __grid_constant__ wl_tmap tq, const __grid_constant__ wl_tmap tk,                  \
        const __grid_constant__ wl_tmap tv, int lq, int kv_len, int heads, int block_tokens, float scale) {    \
        flash_tma_d128<BC, ST>(out, &tq, &tk, &tv, lq, kv_len, heads, block_tokens, scale);                     \
    }
// Shared memory: 32 KiB of Q, then ST stages of 2·BC·256 bytes (the H200 gives a block 227 KiB).
WL_FLASH_TMA(128, 3)
#endif
