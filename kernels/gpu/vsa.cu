// Video sparse attention (kernels/src/vsa.rs has the definition and the CPU reference), in three
// portable kernels: tile means, the coarse branch with the top-k selection, and the fine branch
// over the kept tiles. Tokens stay in grid order; the tiling is index arrays (`order`: grid index
// of each tiled position, `offsets`/`sizes` per tile), so no permuted copies are made. This is the
// correctness-first version (one warp per query and head, like the portable attention kernel);
// the tensor-core block-sparse kernel is the speed step.

#define WL_VSA_MAX_D 256
#define WL_VSA_WARPS 4

// out[j, h, :] = mean of x[order[p], h, :] over tile j's positions p (f32).
template <typename T>
WL_DEVICE void vsa_tile_means(float* out, const T* x, const int* order, const int* offsets, const int* sizes,
                              int heads, int d) {
    const int j = blockIdx.x, h = blockIdx.y;
    const int first = offsets[j], n = sizes[j];
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        double acc = 0.0;
        for (int p = first; p < first + n; ++p) acc += wl_ld(x, ((wl_u64)order[p] * heads + h) * d + e);
        out[((wl_u64)j * heads + h) * d + e] = (float)(acc / n);
    }
}

// One block per (query tile i, head h): coarse scores against every key tile (in dynamic shared
// memory), their softmax applied to the key-tile means (`coarse[i, h, :]`), and the `top_k` best
// key tiles (ties to the lower index) written in increasing index order to `kept[i, h, :]`.
// A warp scores one key tile at a time, its lanes reading consecutive elements of the tile's mean
// (one thread a tile read rows a head's stride apart: every load its own memory sector).
WL_KERNEL void vsa_coarse(float* coarse, int* kept, const float* qc, const float* kc, const float* vc, int nk,
                          int heads, int d, int top_k, float scale) {
    extern __shared__ float vsa_scores[];
    __shared__ float scratch[1024 / WL_WARP_SIZE];
    const int i = blockIdx.x, h = blockIdx.y;
    const int warp = threadIdx.x / WL_WARP_SIZE, lane = threadIdx.x % WL_WARP_SIZE;
    const int warps = blockDim.x / WL_WARP_SIZE;
    const float* q = qc + ((wl_u64)i * heads + h) * d;
    float qr[WL_VSA_MAX_D / 32];
    for (int t = 0; t < WL_VSA_MAX_D / 32; ++t) {
        const int e = lane + t * WL_WARP_SIZE;
        qr[t] = e < d ? q[e] : 0.0f;
    }
    for (int j = warp; j < nk; j += warps) {
        const float* k = kc + ((wl_u64)j * heads + h) * d;
        float s = 0.0f;
        for (int t = 0; t < WL_VSA_MAX_D / 32; ++t) {
            const int e = lane + t * WL_WARP_SIZE;
            if (e < d) s += qr[t] * k[e];
        }
        for (int o = WL_WARP_SIZE / 2; o > 0; o >>= 1) s += wl_shfl_xor(s, o);
        if (lane == 0) vsa_scores[j] = s * scale;
    }
    __syncthreads();
    float mx = -WL_INF;
    for (int j = threadIdx.x; j < nk; j += blockDim.x) mx = fmaxf(mx, vsa_scores[j]);
    mx = wl_block_max(mx, scratch);
    float sum = 0.0f;
    for (int j = threadIdx.x; j < nk; j += blockDim.x) sum += expf(vsa_scores[j] - mx);
    sum = wl_block_sum(sum, scratch);
    // Each tile's softmax weight once (the second half of the shared memory, the rank flags'
    // place until the ranking below), not once per output element.
    float* prob = vsa_scores + nk;
    for (int j = threadIdx.x; j < nk; j += blockDim.x) prob[j] = expf(vsa_scores[j] - mx) / sum;
    __syncthreads();
    for (int e = threadIdx.x; e < d; e += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < nk; ++j) acc += prob[j] * vc[((wl_u64)j * heads + h) * d + e];
        coarse[((wl_u64)i * heads + h) * d + e] = acc;
    }
    // Rank of each tile: how many beat it (higher score, or equal and earlier). Exactly top_k
    // tiles have a rank below top_k; the flags take the weights' place once all have read them.
    __syncthreads();
    int* rank_ok = (int*)(vsa_scores + nk);
    for (int j = threadIdx.x; j < nk; j += blockDim.x) {
        const float sj = vsa_scores[j];
        int rank = 0;
        for (int m = 0; m < nk && rank < top_k; ++m) {
            const float sm = vsa_scores[m];
            rank += (sm > sj || (sm == sj && m < j)) ? 1 : 0;
        }
        rank_ok[j] = rank < top_k;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int* dst = kept + ((wl_u64)i * heads + h) * top_k;
        int n = 0;
        for (int j = 0; j < nk && n < top_k; ++j)
            if (rank_ok[j]) dst[n++] = j;
    }
}

// One warp per (tiled query position p, head): online softmax over the tokens of the kept key
// tiles, lanes scoring a key each; out = fine + gate · coarse (gate 1 when absent).
template <typename T>
WL_DEVICE void vsa_fine(T* out, const T* q, const T* k, const T* v, const T* gate, int has_gate, const float* coarse,
                        const int* kept, const int* q_order, const int* q_tile, const int* k_order,
                        const int* k_offsets, const int* k_sizes, int lq, int heads, int d, int top_k,
                        float scale) {
    __shared__ float qs[WL_VSA_WARPS][WL_VSA_MAX_D];
    const int warp = threadIdx.x / WL_WARP_SIZE, lane = threadIdx.x % WL_WARP_SIZE;
    const wl_u64 job = (wl_u64)blockIdx.x * WL_VSA_WARPS + warp;
    const bool active = job < (wl_u64)lq * heads;
    const int p = active ? (int)(job / heads) : 0, h = active ? (int)(job % heads) : 0;
    const int g = q_order[p], tile = q_tile[p];
    const wl_u64 row = (wl_u64)heads * d;
    for (int e = lane; e < d; e += WL_WARP_SIZE) qs[warp][e] = active ? wl_ld(q, (wl_u64)g * row + (wl_u64)h * d + e) : 0.0f;
    __syncthreads();
    if (!active) return;
    const int per_lane = (d + WL_WARP_SIZE - 1) / WL_WARP_SIZE;
    float acc[WL_VSA_MAX_D / 32];
    for (int e = 0; e < WL_VSA_MAX_D / 32; ++e) acc[e] = 0.0f;
    float m = -WL_INF, l = 0.0f;
    const int* mine = kept + ((wl_u64)tile * heads + h) * top_k;
    for (int t = 0; t < top_k; ++t) {
        const int j = mine[t], first = k_offsets[j], n = k_sizes[j];
        for (int base = 0; base < n; base += WL_WARP_SIZE) {
            const int idx = base + lane;
            float s = -WL_INF;
            int key = 0;
            if (idx < n) {
                key = k_order[first + idx];
                const wl_u64 kr = (wl_u64)key * row + (wl_u64)h * d;
                float dot = 0.0f;
                for (int e = 0; e < d; ++e) dot += qs[warp][e] * wl_ld(k, kr + e);
                s = dot * scale;
            }
            float mx = s;
            for (int o = WL_WARP_SIZE / 2; o > 0; o >>= 1) mx = fmaxf(mx, wl_shfl_xor(mx, o));
            const float m_new = fmaxf(m, mx);
            const float pr = idx < n ? expf(s - m_new) : 0.0f;
            const float corr = expf(m - m_new);
            float ps = pr;
            for (int o = WL_WARP_SIZE / 2; o > 0; o >>= 1) ps += wl_shfl_xor(ps, o);
            l = l * corr + ps;
            for (int e = 0; e < per_lane; ++e) acc[e] *= corr;
            const int cnt = min(WL_WARP_SIZE, n - base);
            for (int u = 0; u < cnt; ++u) {
                const float pu = wl_shfl(pr, u);
                const int ku = wl_shfl(key, u);
                const wl_u64 vr = (wl_u64)ku * row + (wl_u64)h * d;
                for (int e = 0; e < per_lane; ++e) {
                    const int dim = lane + e * WL_WARP_SIZE;
                    if (dim < d) acc[e] += pu * wl_ld(v, vr + dim);
                }
            }
            m = m_new;
        }
    }
    const float inv = 1.0f / l;
    const float* c = coarse + ((wl_u64)tile * heads + h) * d;
    for (int e = 0; e < per_lane; ++e) {
        const int dim = lane + e * WL_WARP_SIZE;
        if (dim < d) {
            const wl_u64 at = (wl_u64)g * row + (wl_u64)h * d + dim;
            const float gv = has_gate ? wl_ld(gate, at) : 1.0f;
            wl_st(out, at, acc[e] * inv + gv * c[dim]);
        }
    }
}

#define WL_VSA(T, tn)                                                                                         \
    WL_KERNEL void vsa_tile_means_##tn(float* out, const T* x, const int* order, const int* offsets,           \
                                       const int* sizes, int heads, int d) {                                   \
        vsa_tile_means(out, x, order, offsets, sizes, heads, d);                                               \
    }                                                                                                         \
    WL_KERNEL void vsa_fine_##tn(T* out, const T* q, const T* k, const T* v, const T* gate, int has_gate,       \
                                 const float* coarse,                                                         \
                                 const int* kept, const int* q_order, const int* q_tile, const int* k_order,  \
                                 const int* k_offsets, const int* k_sizes, int lq, int heads, int d, int top_k, \
                                 float scale) {                                                               \
        vsa_fine(out, q, k, v, gate, has_gate, coarse, kept, q_order, q_tile, k_order, k_offsets, k_sizes, lq, heads, d,  \
                 top_k, scale);                                                                               \
    }

WL_VSA(float, f32)
WL_VSA(wl_bf16, bf16)
