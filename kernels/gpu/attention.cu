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
// Flash attention forward on tensor cores: bf16 q/k/v [L, heads, 128], f32 accumulation and
// online softmax (base 2), bf16 out. A block of 8 warps takes 128 queries of one head (staged in
// shared memory); each warp owns 16 of them. Keys go by in tiles of 64, double-buffered with
// cp.async so the next tile loads while this one is multiplied. Every operand reaches the tensor
// cores through ldmatrix (V transposed on the way). The f32 output accumulators alone take 64
// registers a thread, so one 8-warp block per SM: forcing two made ptxas spill and ran slower
// (measured on the H200). Keys past `kv_len`, or past a query's chunk when `block_tokens > 0`,
// are masked.
#define FA_D 128
#define FA_WARPS 8
#define FA_BR (16 * FA_WARPS)
#define FA_BC 64
#define FA_PAD (FA_D + 8)
#define FA_TILE (FA_BC * FA_PAD)
// Dynamic shared memory: the Q tile, then 2 stages × (K + V) tiles.
#define FA_SMEM_BYTES ((FA_BR * FA_PAD + 2 * 2 * FA_TILE) * 2)

WL_DEVICE void fa_load_rows(wl_bf16* dst, const wl_bf16* src, int first, int rows, int limit, wl_u64 row, int h) {
    for (int i = threadIdx.x; i < rows * FA_D / 8; i += blockDim.x) {
        const int r = i / (FA_D / 8), c8 = (i % (FA_D / 8)) * 8;
        const bool valid = first + r < limit;
        const wl_u64 at = (wl_u64)(valid ? first + r : 0) * row + (wl_u64)h * FA_D + c8;
        wl_cp_async16(dst + r * FA_PAD + c8, src + at, valid);
    }
}

WL_KERNEL void __launch_bounds__(256, 1)
    flash_attention_bf16_d128(wl_bf16* out, const wl_bf16* q, const wl_bf16* k, const wl_bf16* v, int lq, int kv_len,
                              int heads, int block_tokens, float scale) {
    extern __shared__ __align__(16) unsigned char fa_smem[];
    wl_bf16* qs = (wl_bf16*)fa_smem;
    wl_bf16* tiles = qs + FA_BR * FA_PAD;  // [stage][K|V][FA_TILE]
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int h = blockIdx.y;
    const int qb = blockIdx.x * FA_BR;
    const wl_u64 row = (wl_u64)heads * FA_D;
    const int r0 = qb + warp * 16 + lane / 4, r1 = r0 + 8;  // this thread's two query rows
    const int cq = (lane % 4) * 2;
    // Scores in base 2: exp(x·scale) = exp2(x·scale·log2 e).
    const float scale2 = scale * 1.4426950408889634f;

    int lim0 = kv_len, lim1 = kv_len;
    int block_end = kv_len;  // keys any query of this block may see
    if (block_tokens > 0) {
        lim0 = min(kv_len, (r0 / block_tokens + 1) * block_tokens);
        lim1 = min(kv_len, (r1 / block_tokens + 1) * block_tokens);
        const int last_q = min(lq - 1, qb + FA_BR - 1);
        block_end = min(kv_len, (last_q / block_tokens + 1) * block_tokens);
    }
    // Group 0: the Q tile with the first K/V tile.
    fa_load_rows(qs, q, qb, FA_BR, lq, row, h);
    fa_load_rows(tiles, k, 0, FA_BC, kv_len, row, h);
    fa_load_rows(tiles + FA_TILE, v, 0, FA_BC, kv_len, row, h);
    wl_cp_async_commit();

    // ldmatrix row addresses: lane l serves matrix l/8, row l%8.
    const int lm = lane / 8, lr = lane % 8;
    const wl_bf16* q_row = qs + (warp * 16 + lr + (lm % 2) * 8) * FA_PAD + (lm / 2) * 8;

    float o[16][4];
    for (int j = 0; j < 16; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m0 = -WL_INF, m1 = -WL_INF, l0 = 0.0f, l1 = 0.0f;

    int stage = 0;
    for (int kb = 0; kb < block_end; kb += FA_BC, stage ^= 1) {
        if (kb + FA_BC < block_end) {
            wl_bf16* next = tiles + (stage ^ 1) * 2 * FA_TILE;
            fa_load_rows(next, k, kb + FA_BC, FA_BC, kv_len, row, h);
            fa_load_rows(next + FA_TILE, v, kb + FA_BC, FA_BC, kv_len, row, h);
            wl_cp_async_commit();
            wl_cp_async_wait_one();
        } else {
            wl_cp_async_wait_all();
        }
        __syncthreads();
        const wl_bf16* ks = tiles + stage * 2 * FA_TILE;
        const wl_bf16* vs = ks + FA_TILE;

        // S = Q Kᵀ for this warp's 16 rows × 64 keys, two 16-dim steps per K ldmatrix.
        float s[8][4];
        for (int j = 0; j < 8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
        for (int kk = 0; kk < 8; kk += 2) {
            unsigned int qa0[4], qa1[4];
            wl_ldmatrix_x4(qa0, q_row + kk * 16);
            wl_ldmatrix_x4(qa1, q_row + kk * 16 + 16);
            for (int j = 0; j < 8; ++j) {
                unsigned int b[4];
                wl_ldmatrix_x4(b, ks + (j * 8 + lr) * FA_PAD + kk * 16 + lm * 8);
                wl_mma_16816(s[j], qa0, b);
                wl_mma_16816(s[j], qa1, b + 2);
            }
        }
        // Mask, then the online softmax update of both rows.
        float mx0 = -WL_INF, mx1 = -WL_INF;
        for (int j = 0; j < 8; ++j) {
            const int key = kb + j * 8 + cq;
            s[j][0] = key < lim0 ? s[j][0] * scale2 : -WL_INF;
            s[j][1] = key + 1 < lim0 ? s[j][1] * scale2 : -WL_INF;
            s[j][2] = key < lim1 ? s[j][2] * scale2 : -WL_INF;
            s[j][3] = key + 1 < lim1 ? s[j][3] * scale2 : -WL_INF;
            mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
            mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
        }
        for (int o2 = 1; o2 < 4; o2 <<= 1) {
            mx0 = fmaxf(mx0, wl_shfl_xor(mx0, o2));
            mx1 = fmaxf(mx1, wl_shfl_xor(mx1, o2));
        }
        const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        // A row with nothing visible yet keeps m = -inf; exp of (-inf) - (-inf) must not be NaN.
        const float b0 = n0 == -WL_INF ? 0.0f : n0, b1 = n1 == -WL_INF ? 0.0f : n1;
        const float c0 = exp2f(m0 - b0), c1 = exp2f(m1 - b1);
        float sum0 = 0.0f, sum1 = 0.0f;
        for (int j = 0; j < 8; ++j) {
            s[j][0] = exp2f(s[j][0] - b0);
            s[j][1] = exp2f(s[j][1] - b0);
            s[j][2] = exp2f(s[j][2] - b1);
            s[j][3] = exp2f(s[j][3] - b1);
            sum0 += s[j][0] + s[j][1];
            sum1 += s[j][2] + s[j][3];
        }
        for (int o2 = 1; o2 < 4; o2 <<= 1) {
            sum0 += wl_shfl_xor(sum0, o2);
            sum1 += wl_shfl_xor(sum1, o2);
        }
        l0 = l0 * c0 + sum0;
        l1 = l1 * c1 + sum1;
        m0 = n0;
        m1 = n1;
        for (int j = 0; j < 16; ++j) {
            o[j][0] *= c0;
            o[j][1] *= c0;
            o[j][2] *= c1;
            o[j][3] *= c1;
        }
        // O += P V: the S accumulators of two adjacent key groups are the A fragment of one
        // 16-key step; one transposing ldmatrix gives the V fragments of two 8-dim groups.
        for (int kk = 0; kk < 4; ++kk) {
            unsigned int pa[4];
            pa[0] = wl_pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = wl_pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = wl_pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = wl_pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            const wl_bf16* vrow = vs + (kk * 16 + (lm % 2) * 8 + lr) * FA_PAD + (lm / 2) * 8;
            for (int j = 0; j < 16; j += 2) {
                unsigned int b[4];
                wl_ldmatrix_x4_trans(b, vrow + j * 8);
                wl_mma_16816(o[j], pa, b);
                wl_mma_16816(o[j + 1], pa, b + 2);
            }
        }
        // The stage just read is refilled two tiles on: everyone must be done with it first.
        __syncthreads();
    }
    const float i0 = 1.0f / l0, i1 = 1.0f / l1;
    for (int j = 0; j < 16; ++j) {
        const int c = j * 8 + cq;
        if (r0 < lq) *(unsigned int*)(out + (wl_u64)r0 * row + (wl_u64)h * FA_D + c) = wl_pack_bf16(o[j][0] * i0, o[j][1] * i0);
        if (r1 < lq) *(unsigned int*)(out + (wl_u64)r1 * row + (wl_u64)h * FA_D + c) = wl_pack_bf16(o[j][2] * i1, o[j][3] * i1);
    }
}
#endif
