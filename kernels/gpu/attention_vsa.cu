// VSA's fine branch on Hopper, fed by TMA as the dense kernel is. Compiled as part of the
// attention unit (gpu_source.rs appends this file to attention.cu), so it shares fw_softmax,
// fw_rescale and the wgmma helpers.
//
// A producer warpgroup and two consumer warpgroups, each consumer a query tile of its own (same
// head). A 4×4×4 tile of tokens is one box of a five-dimensional map over [t, h, w, heads, dims]
// (64 rows in the tiling's t → h → w order), so tiles need no gather and V no transposed copy;
// the slots of an edge tile that fall outside the grid arrive as zeros and are masked (keys) or
// not written (queries). Per kept key tile, S = Q·Kᵀ and the previous tile's P·V are issued
// together. The consumers do not take turns on the tensor cores as the dense kernel's do: at
// 64-key steps the turns cost more than they overlapped (1-2 % slower in every shape measured on
// the H200, 2026-12-05, BENCHMARKS.md). A consumer holds its query tile
// in registers once it has arrived, so S = Q·Kᵀ reads only K from shared memory (0.4-1.1 %
// faster than reading Q there at each product). Each consumer has a ring of its own: a kernel
// that walked the union of the block's two kept lists through one ring, loading a tile both keep
// once, measured 20-25 % slower on the H200 even where the lists shared 45 % of their tiles.
// Persistent blocks (PERSIST below) measured 1.8-2.6 % faster than a block per pair on an H100
// (2026-12-06): the next pair's loads run under this pair's last steps and stores.
// What bounds this kernel is issue: at the same instructions per cycle as the dense kernel it
// executes 1.57 times the instructions per key, the fixed cost of a step spread over 64 keys
// where the dense kernel's covers 128 (BENCHMARKS.md, 2026-12-05). Not the width of S: two
// warpgroups issuing only this kernel's products (8 × m64n64k16, 4 × m64n128k16 a step) kept
// an H100's tensor cores busy every cycle. Two kept tiles a step (one
// softmax pass per 128 keys), in six one-tile slots per consumer since two K and two V tiles do
// not fit three stages, measured 25-40 % slower: the next pair's V could only start loading
// once this step's scores were done.
#if defined(WL_HAS_WGMMA)
#define VT_STAGES 3
#define VT_TB (64 * 256)  // bytes of one tile of K, V or Q (two 64-dim halves)
struct vsa_grid {
    int t, h, w;  // tokens per axis
    int nh, nw;   // tiles per axis (h, w)
};
// Tile j's origin (t, h, w).
WL_DEVICE void vt_origin(const vsa_grid& g, int j, int* o) {
    o[0] = j / (g.nh * g.nw) * 4;
    o[1] = j / g.nw % g.nh * 4;
    o[2] = j % g.nw * 4;
}
// Tile j's tokens per axis inside the grid (each 1..4), packed t | h << 3 | w << 6.
#define VT_WHOLE (4 | 4 << 3 | 4 << 6)
WL_DEVICE int vt_extent(const vsa_grid& g, int j) {
    int o[3];
    vt_origin(g, j, o);
    return min(4, g.t - o[0]) | min(4, g.h - o[1]) << 3 | min(4, g.w - o[2]) << 6;
}

// Both halves (64 dims each) of token tile `j` of `map`, head h, into `dst`, counted on `bar`.
WL_DEVICE void vt_load(unsigned char* dst, const wl_tmap* map, const vsa_grid& g, int j, int h, void* bar) {
    int o[3];
    vt_origin(g, j, o);
    wl_tma_load_5d(dst, map, 0, h, o[2], o[1], o[0], bar);
    wl_tma_load_5d(dst + VT_TB / 2, map, 64, h, o[2], o[1], o[0], bar);
}

// S (64 × 64) = Q·Kᵀ for the query tile in registers (as fw_load_q leaves it) and the key tile at
// dk.
WL_DEVICE void vt_scores(float* sc, const unsigned int (*qa)[4], unsigned long long dk) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
        wl_wgmma_64x64x16_rs(sc, qa[kk], wl_desc_plus(dk, kk / 4 * (VT_TB / 2) + (kk % 4) * 32), kk);
}
// O += P·V, with P as vt_pack leaves it in registers and V at descriptor dv.
WL_DEVICE void vt_pv(float* o, const unsigned int (*pa)[4], unsigned long long dv) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wl_wgmma_64x128x16_rs_nmajor(o, pa[kk], wl_desc_plus(dv, kk * 2048));
}
// Masks the slots of a key tile (its extent as vt_extent packs it) outside the key grid, then
// the softmax step. A step's issue slots are what these kernels run short of (two consumers'
// softmax against 64-key products), so whole tiles, most of them, skip the masking: the branch
// is uniform over the warpgroup and touches no register a wgmma in flight writes.
WL_DEVICE void vt_softmax(float* sc, const float* m, float* nm, float* corr, float* sum, int ext, int r0, int cq,
                          float scale2) {
    if (ext != VT_WHOLE) {
        const int lt = ext & 7, lh = (ext >> 3) & 7, lw = ext >> 6;
#pragma unroll
        for (int jj = 0; jj < 8; ++jj)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int slot = jj * 8 + cq + c;
                const bool in = (slot >> 4) < lt && ((slot >> 2) & 3) < lh && (slot & 3) < lw;
#pragma unroll
                for (int e = 0; e < 2; ++e) sc[4 * jj + 2 * e + c] = in ? sc[4 * jj + 2 * e + c] : -WL_INF;
            }
    }
    fw_softmax<64, false, FW_LAZY>(sc, m, nm, corr, sum, 0, r0, cq, 64, 0, scale2);
}
// P (the softmax weights in sc) as bf16 pairs, the A operand of vt_pv.
WL_DEVICE void vt_pack(unsigned int (*pa)[4], const float* sc) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[kk][r] = wl_cvt_bf16x2(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
}
// One kept key tile's step: S = Q·Kᵀ (K at dk) and the pending P·V (V at dv) issued together,
// the softmax while P·V runs, then the pending stage's barrier `release` arrived at (where
// `arrive`) and P packed for the next step.
WL_DEVICE void vt_step(float* o, unsigned int (*pa)[4], float* m, float* l, const unsigned int (*qa)[4],
                       unsigned long long dk, unsigned long long dv, int ext, int r0, int cq, float scale2,
                       unsigned long long* release, bool arrive) {
    float sc[32];
    wl_wgmma_fence();
    vt_scores(sc, qa, dk);
    wl_wgmma_commit();
    vt_pv(o, pa, dv);
    wl_wgmma_commit();
    wl_wgmma_wait_one();
    float nm[2], corr[2], sum[2];
    vt_softmax(sc, m, nm, corr, sum, ext, r0, cq, scale2);
    wl_wgmma_wait_all();
    if (arrive) wl_mbar_arrive(release);
    fw_rescale(o, m, l, nm, corr, sum);
    vt_pack(pa, sc);
}
// out = O / l + the coarse term (wl_vsa_coarse) for this thread's rows r0, r0 + 8 of query tile
// i (those inside the query grid).
WL_DEVICE void vt_store(wl_bf16* out, const float* o, const float* l, const float* coarse, const wl_bf16* gate,
                        int mix, const vsa_grid& qg, int i, int h, int heads, int r0, int cq) {
    int qo[3];
    vt_origin(qg, i, qo);
    const float* cv = coarse + ((wl_u64)i * heads + h) * 128;
    const wl_u64 row = (wl_u64)heads * 128;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const float inv = 1.0f / fw_row_sum(l[e]);
        const int r = r0 + e * 8;
        const int tt = qo[0] + (r >> 4), yy = qo[1] + ((r >> 2) & 3), xx = qo[2] + (r & 3);
        if (tt < qg.t && yy < qg.h && xx < qg.w) {
            const wl_u64 base = (((wl_u64)tt * qg.h + yy) * qg.w + xx) * row + (wl_u64)h * 128;
#pragma unroll
            for (int jj = 0; jj < 16; ++jj) {
                const int dim = jj * 8 + cq;
                const float c0 = wl_vsa_coarse(mix, gate, base + dim, cv + dim);
                const float c1 = wl_vsa_coarse(mix, gate, base + dim + 1, cv + dim + 1);
                *(unsigned int*)(out + base + dim) =
                    wl_cvt_bf16x2(o[4 * jj + 2 * e] * inv + c0, o[4 * jj + 2 * e + 1] * inv + c1);
            }
        }
    }
}

// The kept key tiles' extents 32 at a time: lane l holds entry base + l's, so a step takes its
// tile's by one shuffle and no step divides; the next 32 indices load a chunk ahead.
struct vt_extents {
    int ext, ahead;
    WL_DEVICE void init(const vsa_grid& kg, const int* kl, int top_k, int lane) {
        ext = vt_extent(kg, lane < top_k ? kl[lane] : 0);
        ahead = 32 + lane < top_k ? kl[32 + lane] : 0;
    }
    // Entry u's extent (u in this batch of 32).
    WL_DEVICE int at(int u) const { return wl_shfl(ext, u & 31); }
    // After entry u: the next batch where u ends this one (off the path of the products in flight).
    WL_DEVICE void after(const vsa_grid& kg, const int* kl, int top_k, int lane, int u) {
        if ((u & 31) == 31) {
            ext = vt_extent(kg, ahead);
            ahead = u + 33 + lane < top_k ? kl[u + 33 + lane] : 0;
        }
    }
};

// PERSIST: a block per SM walks the items (pairs of query tiles of a head) blockIdx.x,
// + gridDim.x, …; each consumer frees its query tile's memory once it holds the tile in
// registers, so the producer loads the next item's queries and first key tiles while the
// consumers finish this one. Item it is pair it % ⌈nq/2⌉ of head it / ⌈nq/2⌉, the order of
// the one-item grid (pairs along x, heads along y).
template <bool PERSIST>
WL_DEVICE void vsa_fine_tma(wl_bf16* out, const wl_tmap* tq, const wl_tmap* tk, const wl_tmap* tv,
                            const wl_bf16* gate, int mix, const float* coarse, const int* kept, vsa_grid qg,
                            vsa_grid kg, int nq, int heads, int top_k, float scale) {
    constexpr int TB = VT_TB;
    constexpr int CB = TB + VT_STAGES * 2 * TB;  // one consumer's Q and stages
    constexpr int NB = 2 * VT_STAGES + 2;        // barriers per consumer: full, empty, q, q free
    extern __shared__ __align__(1024) unsigned char vt_smem[];
    unsigned long long* bars = (unsigned long long*)(vt_smem + 2 * CB);
    // The warpgroup index through a shuffle, as CUTLASS takes it: the compiler then knows it is
    // uniform and keeps the wgmma descriptors built from it in uniform registers, where each
    // product of a step otherwise paid register-to-uniform moves (~70 issue slots a step).
    const int wg = wl_shfl((int)(threadIdx.x / 128), 0), t = threadIdx.x % 128, lane = t % 32;
    const int pairs = (nq + 1) / 2, items = pairs * heads;
    if (threadIdx.x == 0) {
        for (int c = 0; c < 2; ++c) {
            unsigned long long* b = bars + c * NB;
            for (int s = 0; s < VT_STAGES; ++s) wl_mbar_init(b + s, 1), wl_mbar_init(b + VT_STAGES + s, 1);
            wl_mbar_init(b + 2 * VT_STAGES, 1);
            wl_mbar_init(b + 2 * VT_STAGES + 1, 128);
        }
        wl_mbar_init_fence();
    }
    __syncthreads();
    if (wg == 2) {
        WL_SETMAXNREG_DEC(40);
        // Pair p of head h, the block's qi-th item: its key tiles are each ring's
        // (qi · top_k)-th on.
        auto load = [&](int p, int h, int qi) {
            int tile[2];
            for (int c = 0; c < 2; ++c) {
                tile[c] = min(p * 2 + c, nq - 1);
                unsigned long long* qbar = bars + c * NB + 2 * VT_STAGES;
                if (qi > 0) wl_mbar_wait(qbar + 1, (qi - 1) & 1);
                wl_mbar_expect_tx(qbar, TB);
                vt_load(vt_smem + c * CB, tq, qg, tile[c], h, qbar);
            }
            for (int u = 0; u < top_k; ++u) {
                const int g = qi * top_k + u, s = g % VT_STAGES;
                for (int c = 0; c < 2; ++c) {
                    unsigned long long* full = bars + c * NB;
                    unsigned long long* empty = full + VT_STAGES;
                    if (g >= VT_STAGES) wl_mbar_wait(empty + s, (g / VT_STAGES - 1) & 1);
                    unsigned char* ks = vt_smem + c * CB + TB + s * 2 * TB;
                    const int j = kept[((wl_u64)tile[c] * heads + h) * top_k + u];
                    wl_mbar_expect_tx(full + s, 2 * TB);
                    vt_load(ks, tk, kg, j, h, full + s);
                    vt_load(ks + TB, tv, kg, j, h, full + s);
                }
            }
        };
        if (t == 0) {
            if constexpr (PERSIST) {
                for (int it = blockIdx.x, qi = 0; it < items; it += gridDim.x, ++qi) load(it % pairs, it / pairs, qi);
            } else {
                load(blockIdx.x, blockIdx.y, 0);
            }
        }
        return;
    }
    WL_SETMAXNREG_INC(232);
    unsigned char* qs = vt_smem + wg * CB;
    unsigned char* stages = qs + TB;
    unsigned long long* full = bars + wg * NB;
    unsigned long long* empty = full + VT_STAGES;
    unsigned long long* qbar = full + 2 * VT_STAGES;
    const int r0 = (t / 32) * 16 + lane / 4;  // this thread's rows r0, r0 + 8 (tile slots)
    const int cq = (lane % 4) * 2;
    const float scale2 = scale * 1.4426950408889634f;
    // Descriptors of stage 0's K and V (the others are offsets).
    const unsigned long long dk0 = wl_wgmma_desc_sw128(stages);
    const unsigned long long dv0 = wl_wgmma_desc_sw128_mn(stages + TB, TB / 2);
    auto run = [&](int p, int h, int qi) {
        const int i = min(p * 2 + wg, nq - 1);
        const bool mine = p * 2 + wg < nq;  // the odd block's second consumer only keeps time
        const int* kl = kept + ((wl_u64)i * heads + h) * top_k;
        const int g0 = qi * top_k;  // this item's first tile in the ring
        float o[64];
#pragma unroll
        for (int e = 0; e < 64; ++e) o[e] = 0.0f;
        float m[2] = {-WL_INF, -WL_INF}, l[2] = {0.0f, 0.0f};
        unsigned int pa[4][4];
        vt_extents ex;
        ex.init(kg, kl, top_k, lane);
        wl_mbar_wait(qbar, qi & 1);
        unsigned int qa[8][4];
        fw_load_q(qa, qs, TB / 2, r0, cq);
        if constexpr (PERSIST) wl_mbar_arrive(qbar + 1);
        wl_mbar_wait(full + g0 % VT_STAGES, (g0 / VT_STAGES) & 1);
        {
            float sc[32];
            wl_wgmma_fence();
            vt_scores(sc, qa, wl_desc_plus(dk0, g0 % VT_STAGES * 2 * TB));
            wl_wgmma_commit();
            wl_wgmma_wait_all();
            float nm[2], corr[2], sum[2];
            vt_softmax(sc, m, nm, corr, sum, ex.at(0), r0, cq, scale2);
#pragma unroll
            for (int e = 0; e < 2; ++e) m[e] = nm[e], l[e] = sum[e];
            vt_pack(pa, sc);
        }
        for (int u = 1; u < top_k; ++u) {
            const int g = g0 + u, s = g % VT_STAGES, prev = (g - 1) % VT_STAGES;
            wl_mbar_wait(full + s, (g / VT_STAGES) & 1);
            vt_step(o, pa, m, l, qa, wl_desc_plus(dk0, s * 2 * TB), wl_desc_plus(dv0, prev * 2 * TB), ex.at(u), r0, cq,
                    scale2, empty + prev, t == 0);
            ex.after(kg, kl, top_k, lane, u);
        }
        const int last = (g0 + top_k - 1) % VT_STAGES;
        wl_wgmma_fence();
        vt_pv(o, pa, wl_desc_plus(dv0, last * 2 * TB));
        wl_wgmma_commit();
        wl_wgmma_wait_all();
        // The last stage is refilled only by a next item.
        if (PERSIST && t == 0) wl_mbar_arrive(empty + last);
        if (mine) vt_store(out, o, l, coarse, gate, mix, qg, i, h, heads, r0, cq);
    };
    if constexpr (PERSIST) {
        for (int it = blockIdx.x, qi = 0; it < items; it += gridDim.x, ++qi) run(it % pairs, it / pairs, qi);
    } else {
        run(blockIdx.x, blockIdx.y, 0);
    }
}

// q, k and v as [t, h, w, heads, 128] in boxes of 64 dims × 1 head × 4 × 4 × 4 tokens; two query
// tiles per block.
#define WL_VSA_FINE_TMA(name, PERSIST)                                                                              \
    WL_KERNEL void __launch_bounds__(FT_THREADS, 1)                                                                 \
        name(wl_bf16* out, const __grid_constant__ wl_tmap tq, const __grid_constant__ wl_tmap tk,                  \
             const __grid_constant__ wl_tmap tv, const wl_bf16* gate, int mix, const float* coarse, const int* kept, \
             vsa_grid qg, vsa_grid kg, int nq, int heads, int top_k, float scale) {                                 \
        vsa_fine_tma<PERSIST>(out, &tq, &tk, &tv, gate, mix, coarse, kept, qg, kg, nq, heads, top_k, scale);        \
    }
WL_VSA_FINE_TMA(vsa_fine_tma_bf16_d128, false)
WL_VSA_FINE_TMA(vsa_fine_tma_persist_bf16_d128, true)

#endif
