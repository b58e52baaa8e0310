// VSA's fine branch on Hopper, fed by TMA as the dense kernel is. Compiled as part of the
// attention unit (gpu_source.rs appends this file to attention.cu), so it shares fw_softmax,
// fw_rescale and the wgmma helpers.
//
// A producer warpgroup and two consumer warpgroups, each consumer a query tile of its own (same
// head). A 4×4×4 tile of tokens is one box of a five-dimensional map over [t, h, w, heads, dims]
// (64 rows in the tiling's t → h → w order), so tiles need no gather and V no transposed copy;
// the slots of an edge tile that fall outside the grid arrive as zeros and are masked (keys) or
// not written (queries). Per kept key tile, S = Q·Kᵀ and the previous tile's P·V are issued
// together and the two consumers take turns on the tensor cores. A consumer holds its query tile
// in registers once it has arrived, so S = Q·Kᵀ reads only K from shared memory (0.4-1.1 %
// faster than reading Q there at each product). Each consumer has a ring of its own: a kernel
// that walked the union of the block's two kept lists through one ring, loading a tile both keep
// once, measured 20-25 % slower on the H200 even where the lists shared 45 % of their tiles.
// What bounds this kernel is issue: at the same instructions per cycle as the dense kernel it
// executes 1.57 times the instructions per key, the fixed cost of a step spread over 64 keys
// where the dense kernel's covers 128 (BENCHMARKS.md, 2026-12-05).
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

// S (64 × 64) = Q·Kᵀ for the query tile in registers (as vt_load_q leaves it) and the key tile at
// dk.
WL_DEVICE void vt_scores(float* sc, const unsigned int (*qa)[4], unsigned long long dk) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
        wl_wgmma_64x64x16_rs(sc, qa[kk], wl_desc_plus(dk, kk / 4 * (VT_TB / 2) + (kk % 4) * 32), kk);
}
// This thread's share of the query tile at qs (as vt_load put it: two 64-dim halves of 64 rows,
// 128-byte rows with TMA's 128-byte swizzle, the 16-byte chunk c of row r at c ^ r % 8) in the
// A-fragment layout of wgmma: rows r0 and r0 + 8, dims 16·kk + cq (+1) and the same + 8.
WL_DEVICE void vt_load_q(unsigned int (*qa)[4], const unsigned char* qs, int r0, int cq) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
            const int row = r0 + (r & 1) * 8, d = (kk % 4) * 16 + (r >> 1) * 8 + cq;
            const int at = kk / 4 * (VT_TB / 2) + row * 128 + (((d >> 3) ^ (row & 7)) << 4) + (d & 7) * 2;
            qa[kk][r] = *(const unsigned int*)(qs + at);
        }
}
// O += P·V, with P as vt_pack leaves it in registers and V at descriptor dv.
WL_DEVICE void vt_pv(float* o, const unsigned int (*pa)[4], unsigned long long dv) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) wl_wgmma_64x128x16_rs_nmajor(o, pa[kk], wl_desc_plus(dv, kk * 2048));
}
// Masks the scores of a key tile's slots outside the key grid (its extent as vt_extent packs it;
// an extent of 0 masks the whole tile). A step's issue slots are what these kernels run short of
// (two consumers' softmax against 64-key products), so whole tiles, most of them, skip the
// masking: the branch is uniform over the warpgroup and touches no register a wgmma in flight
// writes.
WL_DEVICE void vt_mask(float* sc, int ext, int cq) {
    if (ext == VT_WHOLE) return;
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
// The masking, then the softmax step.
WL_DEVICE void vt_softmax(float* sc, const float* m, float* nm, float* corr, float* sum, int ext, int r0, int cq,
                          float scale2) {
    vt_mask(sc, ext, cq);
    fw_softmax<64, false, FW_LAZY>(sc, m, nm, corr, sum, 0, r0, cq, 64, 0, scale2);
}
// P (the softmax weights in sc) as bf16 pairs, the A operand of vt_pv.
WL_DEVICE void vt_pack(unsigned int (*pa)[4], const float* sc) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[kk][r] = wl_cvt_bf16x2(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
}
// One kept key tile's step, once the other consumer has issued its products: S = Q·Kᵀ (K at dk)
// and the pending P·V (V at dv) issued together, the other consumer let on the tensor cores, the
// softmax while P·V runs, then the pending stage's barrier `release` arrived at (where `arrive`)
// and P packed for the next step. Without PP (ping-pong) the consumers never wait for each other.
template <bool PP>
WL_DEVICE void vt_step(float* o, unsigned int (*pa)[4], float* m, float* l, const unsigned int (*qa)[4],
                       unsigned long long dk, unsigned long long dv, int ext, int wg, int r0, int cq, float scale2,
                       unsigned long long* release, bool arrive) {
    float sc[32];
    wl_wgmma_fence();
    vt_scores(sc, qa, dk);
    wl_wgmma_commit();
    vt_pv(o, pa, dv);
    wl_wgmma_commit();
    if (PP) wl_named_arrive(2 - wg, 256);
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

template <bool PP>
WL_DEVICE void vsa_fine_tma(wl_bf16* out, const wl_tmap* tq, const wl_tmap* tk, const wl_tmap* tv,
                            const wl_bf16* gate, int mix, const float* coarse, const int* kept, vsa_grid qg,
                            vsa_grid kg, int nq, int heads, int top_k, float scale) {
    constexpr int TB = VT_TB;
    constexpr int CB = TB + VT_STAGES * 2 * TB;  // one consumer's Q and stages
    extern __shared__ __align__(1024) unsigned char vt_smem[];
    unsigned long long* bars = (unsigned long long*)(vt_smem + 2 * CB);  // per consumer: full, empty, q
    // The warpgroup index through a shuffle, as CUTLASS takes it: the compiler then knows it is
    // uniform and keeps the wgmma descriptors built from it in uniform registers, where each
    // product of a step otherwise paid register-to-uniform moves (~70 issue slots a step).
    const int wg = wl_shfl((int)(threadIdx.x / 128), 0), t = threadIdx.x % 128, lane = t % 32;
    const int h = blockIdx.y;
    if (threadIdx.x == 0) {
        for (int c = 0; c < 2; ++c) {
            unsigned long long* b = bars + c * (2 * VT_STAGES + 1);
            for (int s = 0; s < VT_STAGES; ++s) wl_mbar_init(b + s, 1), wl_mbar_init(b + VT_STAGES + s, 1);
            wl_mbar_init(b + 2 * VT_STAGES, 1);
        }
        wl_mbar_init_fence();
    }
    __syncthreads();
    if (wg == 2) {
        WL_SETMAXNREG_DEC(40);
        if (t == 0) {
            int tile[2];
            for (int c = 0; c < 2; ++c) {
                tile[c] = min(blockIdx.x * 2 + c, nq - 1);
                unsigned long long* qbar = bars + c * (2 * VT_STAGES + 1) + 2 * VT_STAGES;
                wl_mbar_expect_tx(qbar, TB);
                vt_load(vt_smem + c * CB, tq, qg, tile[c], h, qbar);
            }
            for (int u = 0; u < top_k; ++u) {
                for (int c = 0; c < 2; ++c) {
                    const int s = u % VT_STAGES;
                    unsigned long long* full = bars + c * (2 * VT_STAGES + 1);
                    unsigned long long* empty = full + VT_STAGES;
                    if (u >= VT_STAGES) wl_mbar_wait(empty + s, (u / VT_STAGES - 1) & 1);
                    unsigned char* ks = vt_smem + c * CB + TB + s * 2 * TB;
                    const int j = kept[((wl_u64)tile[c] * heads + h) * top_k + u];
                    wl_mbar_expect_tx(full + s, 2 * TB);
                    vt_load(ks, tk, kg, j, h, full + s);
                    vt_load(ks + TB, tv, kg, j, h, full + s);
                }
            }
        }
        return;
    }
    WL_SETMAXNREG_INC(232);
    const int i = min(blockIdx.x * 2 + wg, nq - 1);
    const bool mine = blockIdx.x * 2 + wg < nq;  // the odd block's second consumer only keeps time
    unsigned char* qs = vt_smem + wg * CB;
    unsigned char* stages = qs + TB;
    unsigned long long* full = bars + wg * (2 * VT_STAGES + 1);
    unsigned long long* empty = full + VT_STAGES;
    const int* kl = kept + ((wl_u64)i * heads + h) * top_k;
    const int r0 = (t / 32) * 16 + lane / 4;  // this thread's rows r0, r0 + 8 (tile slots)
    const int cq = (lane % 4) * 2;
    const float scale2 = scale * 1.4426950408889634f;
    // Descriptors of the query tile and of stage 0's K and V (the others are offsets).
    const unsigned long long dk0 = wl_wgmma_desc_sw128(stages);
    const unsigned long long dv0 = wl_wgmma_desc_sw128_mn(stages + TB, TB / 2);
    float o[64];
#pragma unroll
    for (int e = 0; e < 64; ++e) o[e] = 0.0f;
    float m[2] = {-WL_INF, -WL_INF}, l[2] = {0.0f, 0.0f};
    unsigned int pa[4][4];
    vt_extents ex;
    ex.init(kg, kl, top_k, lane);
    wl_mbar_wait(full + 2 * VT_STAGES, 0);
    unsigned int qa[8][4];
    vt_load_q(qa, qs, r0, cq);
    wl_mbar_wait(full, 0);
    if (PP && wg == 1) wl_named_arrive(1, 256);
    {
        float sc[32];
        if (PP) wl_named_sync(1 + wg, 256);
        wl_wgmma_fence();
        vt_scores(sc, qa, dk0);
        wl_wgmma_commit();
        if (PP) wl_named_arrive(2 - wg, 256);
        wl_wgmma_wait_all();
        float nm[2], corr[2], sum[2];
        vt_softmax(sc, m, nm, corr, sum, ex.at(0), r0, cq, scale2);
#pragma unroll
        for (int e = 0; e < 2; ++e) m[e] = nm[e], l[e] = sum[e];
        vt_pack(pa, sc);
    }
    for (int u = 1; u < top_k; ++u) {
        const int s = u % VT_STAGES, prev = (u - 1) % VT_STAGES;
        wl_mbar_wait(full + s, (u / VT_STAGES) & 1);
        if (PP) wl_named_sync(1 + wg, 256);
        vt_step<PP>(o, pa, m, l, qa, wl_desc_plus(dk0, s * 2 * TB), wl_desc_plus(dv0, prev * 2 * TB), ex.at(u), wg, r0,
                cq, scale2, empty + prev, t == 0);
        ex.after(kg, kl, top_k, lane, u);
    }
    if (PP && wg == 0) wl_named_sync(1, 256);
    wl_wgmma_fence();
    vt_pv(o, pa, wl_desc_plus(dv0, (top_k - 1) % VT_STAGES * 2 * TB));
    wl_wgmma_commit();
    wl_wgmma_wait_all();
    if (mine) vt_store(out, o, l, coarse, gate, mix, qg, i, h, heads, r0, cq);
}

// q, k and v as [t, h, w, heads, 128] in boxes of 64 dims × 1 head × 4 × 4 × 4 tokens; two query
// tiles per block.
WL_KERNEL void __launch_bounds__(FT_THREADS, 1)
    vsa_fine_tma_bf16_d128(wl_bf16* out, const __grid_constant__ wl_tmap tq, const __grid_constant__ wl_tmap tk,
                           const __grid_constant__ wl_tmap tv, const wl_bf16* gate, int mix, const float* coarse,
                           const int* kept, vsa_grid qg, vsa_grid kg, int nq, int heads, int top_k, float scale) {
    vsa_fine_tma<true>(out, &tq, &tk, &tv, gate, mix, coarse, kept, qg, kg, nq, heads, top_k, scale);
}
// The same without the consumers' turn-taking on the tensor cores (`WORLDLINE_VSA_FINE=free`): at
// 64-key steps the turns may cost more than they overlap (barrier stalls per instruction 1.18
// against the dense kernel's 0.77, Nsight Compute, 2026-12-05). Unmeasured so far.
WL_KERNEL void __launch_bounds__(FT_THREADS, 1)
    vsa_fine_tma_free_bf16_d128(wl_bf16* out, const __grid_constant__ wl_tmap tq, const __grid_constant__ wl_tmap tk,
                                const __grid_constant__ wl_tmap tv, const wl_bf16* gate, int mix, const float* coarse,
                                const int* kept, vsa_grid qg, vsa_grid kg, int nq, int heads, int top_k, float scale) {
    vsa_fine_tma<false>(out, &tq, &tk, &tv, gate, mix, coarse, kept, qg, kg, nq, heads, top_k, scale);
}

// Two kept tiles a step (`WORLDLINE_VSA_FINE=pair`): S for both (128 keys) and the previous
// pair's P·V issued together and one softmax pass over the 128 columns, so a step's fixed cost
// (the turn-taking, row-max shuffles, rescale vote, barriers) covers 128 keys as the dense
// kernel's does; the profile of 2026-12-05 put the 64-key kernel's 1.57 times the dense
// kernel's instructions per key there. Two K and two V tiles a step do not fit three K|V stages
// per consumer, so each consumer's 96 KiB is six 16 KiB slots filled in the order the steps use
// them: K of pair 0; then per step K of pair p and V of pair p - 1; last the last pair's V. A K
// slot is freed once its scores are done, so the next pair's V arrives under this step's
// softmax. The query tile stays in shared memory (an SS product): with S and P twice as wide,
// the registers that held it are needed. An odd list's last pair repeats its last tile, masked
// whole, so its V is a real tile's (finite) weighed by zeros.
#define VP_SLOTS 6

// S (64 × 64) = Q·Kᵀ, Q (descriptor dq) and K (dk) both in shared memory as vt_load puts them.
WL_DEVICE void vp_scores(float* sc, unsigned long long dq, unsigned long long dk) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        const unsigned int at = kk / 4 * (VT_TB / 2) + (kk % 4) * 32;
        wl_wgmma_64x64x16_ss(sc, wl_desc_plus(dq, at), wl_desc_plus(dk, at), kk);
    }
}
// P (128 keys of softmax weights in sc) as bf16 pairs: pa[0..4) the first tile's, pa[4..8) the
// second's.
WL_DEVICE void vp_pack(unsigned int (*pa)[4], const float* sc) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)
#pragma unroll
        for (int r = 0; r < 4; ++r) pa[kk][r] = wl_cvt_bf16x2(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
}
// The slots a step reads: K of its pair, V of the pair before.
struct vp_slots {
    int k[2], v[2];
};
// One pair's step, once the other consumer has issued its products (as vt_step): both S
// products and both pending P·V products issued together, the other consumer let on the
// tensor cores, the K slots freed once S is done, one softmax pass over 128 columns while P·V
// runs, then the V slots freed (where `arrive`) and P packed for the next step.
template <bool PP>
WL_DEVICE void vp_step(float* o, unsigned int (*pa)[4], float* m, float* l, unsigned long long dq,
                       unsigned long long dk0, unsigned long long dv0, const vp_slots& sl, int ext0, int ext1, int wg,
                       int r0, int cq, float scale2, unsigned long long* empty, bool arrive) {
    float sc[64];
    wl_wgmma_fence();
    vp_scores(sc, dq, wl_desc_plus(dk0, sl.k[0] * VT_TB));
    vp_scores(sc + 32, dq, wl_desc_plus(dk0, sl.k[1] * VT_TB));
    wl_wgmma_commit();
    vt_pv(o, pa, wl_desc_plus(dv0, sl.v[0] * VT_TB));
    vt_pv(o, pa + 4, wl_desc_plus(dv0, sl.v[1] * VT_TB));
    wl_wgmma_commit();
    if (PP) wl_named_arrive(2 - wg, 256);
    wl_wgmma_wait_one();
    if (arrive) wl_mbar_arrive(empty + sl.k[0]), wl_mbar_arrive(empty + sl.k[1]);
    vt_mask(sc, ext0, cq);
    vt_mask(sc + 32, ext1, cq);
    float nm[2], corr[2], sum[2];
    fw_softmax<128, false, FW_LAZY>(sc, m, nm, corr, sum, 0, r0, cq, 128, 0, scale2);
    wl_wgmma_wait_all();
    if (arrive) wl_mbar_arrive(empty + sl.v[0]), wl_mbar_arrive(empty + sl.v[1]);
    fw_rescale(o, m, l, nm, corr, sum);
    vp_pack(pa, sc);
}

// Waits for the slots of sequence numbers n .. n + count (ring positions n % VP_SLOTS, each
// refilled every VP_SLOTS) to be full.
WL_DEVICE void vp_wait(unsigned long long* full, int n, int count) {
    for (int x = n; x < n + count; ++x) wl_mbar_wait(full + x % VP_SLOTS, (x / VP_SLOTS) & 1);
}

template <bool PP>
WL_DEVICE void vsa_fine_pair(wl_bf16* out, const wl_tmap* tq, const wl_tmap* tk, const wl_tmap* tv,
                             const wl_bf16* gate, int mix, const float* coarse, const int* kept, vsa_grid qg,
                             vsa_grid kg, int nq, int heads, int top_k, float scale) {
    constexpr int TB = VT_TB;
    constexpr int CB = TB + VP_SLOTS * TB;  // one consumer's Q and slots
    constexpr int NB = 2 * VP_SLOTS + 1;    // one consumer's barriers: full, empty, q
    extern __shared__ __align__(1024) unsigned char vt_smem[];
    unsigned long long* bars = (unsigned long long*)(vt_smem + 2 * CB);
    const int wg = wl_shfl((int)(threadIdx.x / 128), 0), t = threadIdx.x % 128, lane = t % 32;
    const int h = blockIdx.y;
    const int pairs = (top_k + 1) / 2;
    if (threadIdx.x == 0) {
        for (int b = 0; b < 2 * NB; ++b) wl_mbar_init(bars + b, 1);
        wl_mbar_init_fence();
    }
    __syncthreads();
    if (wg == 2) {
        WL_SETMAXNREG_DEC(40);
        if (t == 0) {
            int tile[2];
            for (int c = 0; c < 2; ++c) {
                tile[c] = min(blockIdx.x * 2 + c, nq - 1);
                unsigned long long* qbar = bars + c * NB + 2 * VP_SLOTS;
                wl_mbar_expect_tx(qbar, TB);
                vt_load(vt_smem + c * CB, tq, qg, tile[c], h, qbar);
            }
            // Both consumers take the same number of slots a step: n counts them for each.
            int n = 0;
            for (int p = 0; p <= pairs; ++p) {
                int sent = n;
                for (int c = 0; c < 2; ++c) {
                    const int* kl = kept + ((wl_u64)tile[c] * heads + h) * top_k;
                    unsigned long long* full = bars + c * NB;
                    unsigned long long* empty = full + VP_SLOTS;
                    unsigned char* slots = vt_smem + c * CB + TB;
                    sent = n;
                    // x = 0, 1: K of pair p; x = 2, 3: V of pair p - 1.
                    for (int x = 0; x < 4; ++x) {
                        const int pair = x < 2 ? p : p - 1;
                        if (pair < 0 || pair >= pairs) continue;
                        const int j = kl[min(2 * pair + (x & 1), top_k - 1)];
                        const int s = sent % VP_SLOTS;
                        if (sent >= VP_SLOTS) wl_mbar_wait(empty + s, (sent / VP_SLOTS - 1) & 1);
                        wl_mbar_expect_tx(full + s, TB);
                        vt_load(slots + s * TB, x < 2 ? tk : tv, kg, j, h, full + s);
                        ++sent;
                    }
                }
                n = sent;
            }
        }
        return;
    }
    WL_SETMAXNREG_INC(232);
    const int i = min(blockIdx.x * 2 + wg, nq - 1);
    const bool mine = blockIdx.x * 2 + wg < nq;  // the odd block's second consumer only keeps time
    unsigned char* qs = vt_smem + wg * CB;
    unsigned char* slots = qs + TB;
    unsigned long long* full = bars + wg * NB;
    unsigned long long* empty = full + VP_SLOTS;
    const int* kl = kept + ((wl_u64)i * heads + h) * top_k;
    const int r0 = (t / 32) * 16 + lane / 4;  // this thread's rows r0, r0 + 8 (tile slots)
    const int cq = (lane % 4) * 2;
    const float scale2 = scale * 1.4426950408889634f;
    const unsigned long long dq = wl_wgmma_desc_sw128(qs);
    const unsigned long long dk0 = wl_wgmma_desc_sw128(slots);
    const unsigned long long dv0 = wl_wgmma_desc_sw128_mn(slots, TB / 2);
    float o[64];
#pragma unroll
    for (int e = 0; e < 64; ++e) o[e] = 0.0f;
    float m[2] = {-WL_INF, -WL_INF}, l[2] = {0.0f, 0.0f};
    unsigned int pa[8][4];
    vt_extents ex;
    ex.init(kg, kl, top_k, lane);
    // Entry u's extent; past the list (an odd list's repeated tile) none of it. Every lane
    // takes part in the shuffle.
    auto extent = [&](int u) {
        const int e = ex.at(u);
        return u < top_k ? e : 0;
    };
    wl_mbar_wait(full + 2 * VP_SLOTS, 0);
    vp_wait(full, 0, 2);
    if (PP && wg == 1) wl_named_arrive(1, 256);
    {
        float sc[64];
        if (PP) wl_named_sync(1 + wg, 256);
        wl_wgmma_fence();
        vp_scores(sc, dq, dk0);
        vp_scores(sc + 32, dq, wl_desc_plus(dk0, TB));
        wl_wgmma_commit();
        if (PP) wl_named_arrive(2 - wg, 256);
        wl_wgmma_wait_all();
        if (t == 0) wl_mbar_arrive(empty), wl_mbar_arrive(empty + 1);
        vt_mask(sc, extent(0), cq);
        vt_mask(sc + 32, extent(1), cq);
        float nm[2], corr[2], sum[2];
        fw_softmax<128, false, FW_LAZY>(sc, m, nm, corr, sum, 0, r0, cq, 128, 0, scale2);
#pragma unroll
        for (int e = 0; e < 2; ++e) m[e] = nm[e], l[e] = sum[e];
        vp_pack(pa, sc);
    }
    // Step p reads sequence numbers 4p - 2 .. 4p + 1: K of pair p, then V of pair p - 1.
    for (int p = 1; p < pairs; ++p) {
        const int n = 4 * p - 2;
        vp_wait(full, n, 4);
        vp_slots sl;
#pragma unroll
        for (int x = 0; x < 2; ++x) sl.k[x] = (n + x) % VP_SLOTS, sl.v[x] = (n + 2 + x) % VP_SLOTS;
        if (PP) wl_named_sync(1 + wg, 256);
        vp_step<PP>(o, pa, m, l, dq, dk0, dv0, sl, extent(2 * p), extent(2 * p + 1), wg, r0, cq, scale2, empty,
                    t == 0);
        ex.after(kg, kl, top_k, lane, 2 * p + 1);
    }
    if (PP && wg == 0) wl_named_sync(1, 256);
    const int n = 4 * pairs - 2;  // the last pair's V
    vp_wait(full, n, 2);
    wl_wgmma_fence();
    vt_pv(o, pa, wl_desc_plus(dv0, n % VP_SLOTS * TB));
    vt_pv(o, pa + 4, wl_desc_plus(dv0, (n + 1) % VP_SLOTS * TB));
    wl_wgmma_commit();
    wl_wgmma_wait_all();
    if (mine) vt_store(out, o, l, coarse, gate, mix, qg, i, h, heads, r0, cq);
}

// As vsa_fine_tma_bf16_d128, two kept tiles a step.
WL_KERNEL void __launch_bounds__(FT_THREADS, 1)
    vsa_fine_tma_pair_bf16_d128(wl_bf16* out, const __grid_constant__ wl_tmap tq, const __grid_constant__ wl_tmap tk,
                                const __grid_constant__ wl_tmap tv, const wl_bf16* gate, int mix, const float* coarse,
                                const int* kept, vsa_grid qg, vsa_grid kg, int nq, int heads, int top_k, float scale) {
    vsa_fine_pair<true>(out, &tq, &tk, &tv, gate, mix, coarse, kept, qg, kg, nq, heads, top_k, scale);
}

#endif
