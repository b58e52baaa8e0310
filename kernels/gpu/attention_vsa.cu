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
// Nor did more tiles in flight help: each consumer's three stages as six 16 KiB units (a 32-key
// tile in one) measured 14-22 % slower on an H100, its consumers waiting longer on the tiles
// (2026-12-07, BENCHMARKS.md; branch vsa-packed).
// Persistent blocks (PERSIST below) measured 1.8-2.6 % faster than a block per pair on an H100
// (2026-12-06): the next pair's loads run under this pair's last steps and stores.
// One producer thread refills both consumers' rings in lock-step. A producer warp per consumer,
// so that a consumer ahead of the other need not wait for loads held behind the other's free
// stage, measured 0.95-0.98x as fast as this kernel on an H100 (2026-12-07). TMA prefetches
// into L2 two steps ahead of the loads, for the ~22 % of loads that miss L2, 0.58-0.70x. Both
// are in BENCHMARKS.md. So is how touchy the kernel is: with that prefetch compiled in but off,
// ptxas scheduled the consumers' code differently, and by the two calls' ratios the kernel was
// ~5 % slower than this one, whose producer code is unchanged.
// What bounds this kernel at full clock is its K/V traffic from L2. Query rows dealt so that
// rows without a query skip their softmax (vt_deal) and half key tiles in 32-key steps
// (vt_kind) took 22 % of its instructions away and made it 6 % faster at Nsight Compute's
// 1.43 GHz (issue slots 31 % busy, L2 at 70 % of its throughput), but 0-1 % at full clock on
// an H100 (2026-12-06, BENCHMARKS.md). Not the width of S either: two
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

// Half key tiles. A kept key tile whose slots in the grid are exactly half its 64 (the window's
// last frames, lt = 2, or its last rows, lh = 2: with random inputs half the tiles kept) takes a
// step over 32 keys: S is 64 × 32 and P·V runs over 32 keys, the softmax over 32 columns with no
// masking. lt = 2 keeps slots 0-31; lh = 2 keeps the 8-slot groups 0, 2, 4, 6, which the
// products read through descriptors whose 8-row groups are 2048 bytes apart, not 1024.
// Kind 0: all 64 slots (masked where outside the grid), 1: slots 0-31, 2: the even groups.
#define VT_HALF_T (2 | 4 << 3 | 4 << 6)
#define VT_HALF_H (4 | 2 << 3 | 4 << 6)
WL_DEVICE int vt_kind(int ext) { return ext == VT_HALF_T ? 1 : ext == VT_HALF_H ? 2 : 0; }
// A K or V descriptor for a tile of kind `kind` (the 8-row groups' stride doubled for kind 2),
// and the bytes between its P·V's 16-key steps.
WL_DEVICE unsigned long long vt_desc(unsigned long long d, int kind) { return kind == 2 ? d + (64ull << 32) : d; }
WL_DEVICE unsigned int vt_kstep(int kind) { return kind == 2 ? 4096 : 2048; }
// EXACT: a key tile of at most two frames, or of two rows of h, comes in a box of 32 tokens
// (4 × 4 × 2 frames, or 4 × 2 × 4), not a whole box whose other half lies outside the grid.
// Nsight Compute counted those outer halves in full (H100, 2026-12-06: the fine kernel's 7.16 GB
// from L2 are what whole boxes would take, where its kept tiles hold 5.3 GB of K/V), and the
// return path from L2 is what bounds this kernel. Either box holds its tokens in slots 0-31
// (the frame box in the whole box's slot order), so both take a 32-key step; the frame box's
// tiles other than frame halves (quarter tiles, one-frame tiles, partial w) are masked there.
// Box 0: whole, 1: frames, 2: rows.
WL_DEVICE int vt_box(int ext) { return ext == VT_HALF_H ? 2 : (ext & 7) <= 2 ? 1 : 0; }
// A tile's step: 0 over 64 keys, 1 over 32 in slots 0-31, 2 over 32 in the even 8-slot groups.
WL_DEVICE int vt_step_kind(int ext, bool trim, bool exact) {
    if (exact) return vt_box(ext) ? 1 : 0;
    return trim ? vt_kind(ext) : 0;
}

// S (64 × NC) = Q·Kᵀ for the query tile in registers (as fw_load_q leaves it) and the key tile
// at dk.
template <int NC>
WL_DEVICE void vt_scores(float* sc, const unsigned int (*qa)[4], unsigned long long dk) {
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
        const unsigned long long d = wl_desc_plus(dk, kk / 4 * (VT_TB / 2) + (kk % 4) * 32);
        if constexpr (NC == 64) wl_wgmma_64x64x16_rs(sc, qa[kk], d, kk);
        else wl_wgmma_64x32x16_rs(sc, qa[kk], d, kk);
    }
}
// O += P·V over NP keys, with P as vt_pack leaves it in registers and V at descriptor dv, its
// 16-key steps `kstep` bytes apart.
template <int NP>
WL_DEVICE void vt_pv(float* o, const unsigned int (*pa)[4], unsigned long long dv, unsigned int kstep) {
#pragma unroll
    for (int kk = 0; kk < NP / 16; ++kk) wl_wgmma_64x128x16_rs_nmajor(o, pa[kk], wl_desc_plus(dv, kk * kstep));
}
// Masks the slots of a key tile (its extent as vt_extent packs it) outside the key grid, then
// the softmax step. A step's issue slots are what these kernels run short of (two consumers'
// softmax against 64-key products), so whole tiles, most of them, skip the masking: the branch
// is uniform over the warpgroup and touches no register a wgmma in flight writes.
// Rows e whose bit in `live` is clear hold no query and are left alone (vt_deal). Half tiles
// (NC = 32) need no masking; the other tiles of EXACT's frame box do, in the same slot order.
template <int NC>
WL_DEVICE void vt_softmax(float* sc, const float* m, float* nm, float* corr, float* sum, int ext, int live, int cq,
                          float scale2) {
    if (NC == 64 ? ext != VT_WHOLE : ext != VT_HALF_T && ext != VT_HALF_H) {
        const int lt = ext & 7, lh = (ext >> 3) & 7, lw = ext >> 6;
#pragma unroll
        for (int jj = 0; jj < NC / 8; ++jj)
#pragma unroll
            for (int c = 0; c < 2; ++c) {
                const int slot = jj * 8 + cq + c;
                const bool in = (slot >> 4) < lt && ((slot >> 2) & 3) < lh && (slot & 3) < lw;
#pragma unroll
                for (int e = 0; e < 2; ++e)
                    if (live == 3 || live >> e & 1) sc[4 * jj + 2 * e + c] = in ? sc[4 * jj + 2 * e + c] : -WL_INF;
            }
    }
    fw_softmax<NC, false, FW_LAZY>(sc, m, nm, corr, sum, 0, 0, cq, NC, 0, scale2, 0.0f, live);
}
// P (the softmax weights in sc, NC columns) as bf16 pairs, the A operand of vt_pv; rows not in
// `live` keep the zeros they start an item with.
template <int NC>
WL_DEVICE void vt_pack(unsigned int (*pa)[4], const float* sc, int live) {
    auto rows = [&](int r0, int dr) {
#pragma unroll
        for (int kk = 0; kk < NC / 16; ++kk)
#pragma unroll
            for (int r = r0; r < 4; r += dr) pa[kk][r] = wl_cvt_bf16x2(sc[8 * kk + 2 * r], sc[8 * kk + 2 * r + 1]);
    };
    if (live == 3) rows(0, 1);
    else if (live == 1) rows(0, 2);
    else if (live == 2) rows(1, 2);
}

// Which of a query tile's slots this thread's rows e = 0, 1 hold, and which of them hold a query.
// A 3-frame chunk fills 48 of a tile's 64 slots (t = 3 lies outside the grid), the tiles at the
// grid's edge in h fewer. The slots go in groups of eight (t, two rows of h, all of w), and a
// warp's rows e are one such group: a group with no query then skips the softmax whole
// (fw_softmax's `live`). A consumer's warp w shares SM sub-partition w with the other
// consumer's warp w, so the two deal their empty groups to different warps: consumer 0 to its
// warps 0-1, consumer 1 to 2-3, rows e = 1 first. Each sub-partition then issues for 3 groups of
// 4 where it issued for 4.
struct vt_rows {
    int slot[2];
    int live;  // bit e: rows e hold a query
};
WL_DEVICE vt_rows vt_deal(int ext, int wg, int w, int lane) {
    const int lt = ext & 7, lh = (ext >> 3) & 7;
    int full = 0;  // bit g: slot group g (t = g / 2, h from 2 · (g % 2)) holds a query
#pragma unroll
    for (int g = 0; g < 8; ++g) full |= ((g >> 1) < lt && (g & 1) * 2 < lh) << g;
    const int nfull = __popc(full);
    vt_rows r;
    r.live = 0;
    const int ww = wg == 0 ? w ^ 2 : w;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        // This warp's group e in the consumer's order of filling: the groups that hold queries
        // go to the first nfull places, in slot order, the empty ones after.
        const int rank = (ww >> 1) * 4 + e * 2 + (ww & 1);
        const int pick = rank < nfull ? full : ~full & 0xff;
        const int k = rank < nfull ? rank : rank - nfull;
        int g = 0;
        for (int b = 0; b < 8; ++b)
            if ((pick >> b & 1) && __popc(pick & ((1 << b) - 1)) == k) g = b;
        r.slot[e] = g * 8 + lane / 4;
        r.live |= (rank < nfull) << e;
    }
    // Uniform over the warp, and through a shuffle the compiler knows it: the softmax's branches
    // on it then need no divergence handling around their shuffles.
    r.live = wl_shfl(r.live, 0);
    return r;
}
// One kept key tile's step (NC of its keys, NP of the previous tile's): S = Q·Kᵀ (K at dk) and
// the pending P·V (V at dv, its 16-key steps kstep bytes apart) issued together, the softmax
// while P·V runs, then the pending stage's barrier `release` arrived at (where `arrive`) and P
// packed for the next step.
template <int NC, int NP>
WL_DEVICE void vt_step(float* o, unsigned int (*pa)[4], float* m, float* l, const unsigned int (*qa)[4],
                       unsigned long long dk, unsigned long long dv, unsigned int kstep, int ext, int live, int cq,
                       float scale2, unsigned long long* release, bool arrive) {
    float sc[NC / 2];
    wl_wgmma_fence();
    vt_scores<NC>(sc, qa, dk);
    wl_wgmma_commit();
    vt_pv<NP>(o, pa, dv, kstep);
    wl_wgmma_commit();
    wl_wgmma_wait_one();
    float nm[2], corr[2], sum[2];
    vt_softmax<NC>(sc, m, nm, corr, sum, ext, live, cq, scale2);
    wl_wgmma_wait_all();
    if (arrive) wl_mbar_arrive(release);
    fw_rescale(o, m, l, nm, corr, sum);
    vt_pack<NC>(pa, sc, live);
}
// The first step of an item: S and its softmax, no P·V pending.
template <int NC>
WL_DEVICE void vt_first(unsigned int (*pa)[4], float* m, float* l, const unsigned int (*qa)[4], unsigned long long dk,
                        int ext, int live, int cq, float scale2) {
    float sc[NC / 2];
    wl_wgmma_fence();
    vt_scores<NC>(sc, qa, dk);
    wl_wgmma_commit();
    wl_wgmma_wait_all();
    float nm[2], corr[2], sum[2];
    vt_softmax<NC>(sc, m, nm, corr, sum, ext, live, cq, scale2);
#pragma unroll
    for (int e = 0; e < 2; ++e) m[e] = nm[e], l[e] = sum[e];
    vt_pack<NC>(pa, sc, live);
}
// out = O / l + the coarse term (wl_vsa_coarse) for this thread's rows (tile slots `slot`) of
// query tile i, those inside the query grid.
WL_DEVICE void vt_store(wl_bf16* out, const float* o, const float* l, const float* coarse, const wl_bf16* gate,
                        int mix, const vsa_grid& qg, int i, int h, int heads, const int* slot, int cq) {
    int qo[3];
    vt_origin(qg, i, qo);
    const float* cv = coarse + ((wl_u64)i * heads + h) * 128;
    const wl_u64 row = (wl_u64)heads * 128;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const float inv = 1.0f / fw_row_sum(l[e]);
        const int r = slot[e];
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
// the one-item grid (pairs along x, heads along y). TRIM: the query rows dealt as vt_deal says
// and half key tiles in 32-key steps (vt_kind); without it (the kernel before 2026-12-06, kept
// for A/B) the rows in slot order, every one live, and every tile a 64-key step.
template <bool PERSIST, bool TRIM, bool EXACT>
WL_DEVICE void vsa_fine_tma(wl_bf16* out, const wl_tmap* tq, const wl_tmap* tk, const wl_tmap* tv,
                            const wl_tmap* tk_t, const wl_tmap* tv_t, const wl_tmap* tk_h, const wl_tmap* tv_h,
                            const wl_bf16* gate, int mix, const float* coarse, const int* kept, vsa_grid qg,
                            vsa_grid kg, int nq, int heads, int top_k, float scale) {
    static_assert(TRIM || !EXACT, "exact boxes need the half-tile steps");
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
                    const int box = EXACT ? vt_box(vt_extent(kg, j)) : 0;
                    const wl_tmap* mk = box == 1 ? tk_t : box == 2 ? tk_h : tk;
                    const wl_tmap* mv = box == 1 ? tv_t : box == 2 ? tv_h : tv;
                    wl_mbar_expect_tx(full + s, box ? TB : 2 * TB);
                    vt_load(ks, mk, kg, j, h, full + s);
                    vt_load(ks + TB, mv, kg, j, h, full + s);
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
        if constexpr (TRIM)
#pragma unroll
            for (int e = 0; e < 16; ++e) pa[e / 4][e % 4] = 0;
        vt_extents ex;
        ex.init(kg, kl, top_k, lane);
        vt_rows rows = {{(t / 32) * 16 + lane / 4, (t / 32) * 16 + lane / 4 + 8}, 3};
        if constexpr (TRIM) rows = vt_deal(vt_extent(qg, i), wg, t / 32, lane);
        wl_mbar_wait(qbar, qi & 1);
        unsigned int qa[8][4];
        fw_load_q_rows(qa, qs, TB / 2, rows.slot[0], rows.slot[1], cq);
        if constexpr (PERSIST) wl_mbar_arrive(qbar + 1);
        const int live = rows.live;
        wl_mbar_wait(full + g0 % VT_STAGES, (g0 / VT_STAGES) & 1);
        // The previous tile's kind (vt_kind; always 0 without TRIM).
        int pk = vt_step_kind(ex.at(0), TRIM, EXACT);
        {
            const unsigned long long dk = vt_desc(wl_desc_plus(dk0, g0 % VT_STAGES * 2 * TB), pk);
            if (pk == 0) vt_first<64>(pa, m, l, qa, dk, ex.at(0), live, cq, scale2);
            else vt_first<32>(pa, m, l, qa, dk, ex.at(0), live, cq, scale2);
        }
        // Tile u's stage and its barrier's phase, carried from step to step (no divisions).
        int s = g0 % VT_STAGES, phase = (g0 / VT_STAGES) & 1;
        for (int u = 1; u < top_k; ++u) {
            const int prev = s;
            if (++s == VT_STAGES) s = 0, phase ^= 1;
            const int ext = ex.at(u), kind = vt_step_kind(ext, TRIM, EXACT);
            const unsigned long long dk = vt_desc(wl_desc_plus(dk0, s * 2 * TB), kind);
            const unsigned long long dv = vt_desc(wl_desc_plus(dv0, prev * 2 * TB), pk);
            const unsigned int kstep = vt_kstep(pk);
            unsigned long long* rel = empty + prev;
            wl_mbar_wait(full + s, phase);
            if (kind == 0) {
                if (pk == 0) vt_step<64, 64>(o, pa, m, l, qa, dk, dv, kstep, ext, live, cq, scale2, rel, t == 0);
                else vt_step<64, 32>(o, pa, m, l, qa, dk, dv, kstep, ext, live, cq, scale2, rel, t == 0);
            } else {
                if (pk == 0) vt_step<32, 64>(o, pa, m, l, qa, dk, dv, kstep, ext, live, cq, scale2, rel, t == 0);
                else vt_step<32, 32>(o, pa, m, l, qa, dk, dv, kstep, ext, live, cq, scale2, rel, t == 0);
            }
            pk = kind;
            ex.after(kg, kl, top_k, lane, u);
        }
        const int last = s;
        const unsigned long long dv = vt_desc(wl_desc_plus(dv0, last * 2 * TB), pk);
        wl_wgmma_fence();
        if (pk == 0) vt_pv<64>(o, pa, dv, vt_kstep(pk));
        else vt_pv<32>(o, pa, dv, vt_kstep(pk));
        wl_wgmma_commit();
        wl_wgmma_wait_all();
        // The last stage is refilled only by a next item.
        if (PERSIST && t == 0) wl_mbar_arrive(empty + last);
        if (mine) vt_store(out, o, l, coarse, gate, mix, qg, i, h, heads, rows.slot, cq);
    };
    if constexpr (PERSIST) {
        for (int it = blockIdx.x, qi = 0; it < items; it += gridDim.x, ++qi) run(it % pairs, it / pairs, qi);
    } else {
        run(blockIdx.x, blockIdx.y, 0);
    }
}

// q, k and v as [t, h, w, heads, 128] in boxes of 64 dims × 1 head × 4 × 4 × 4 tokens; k and v
// also in boxes of 4 × 4 × 2 (tk_t, tv_t) and 4 × 2 × 4 (tk_h, tv_h) tokens, which only the EXACT
// kernel reads; two query tiles per block.
#define WL_VSA_FINE_TMA(name, PERSIST, TRIM, EXACT)                                                                    \
    WL_KERNEL void __launch_bounds__(FT_THREADS, 1)                                                                    \
        name(wl_bf16* out, const __grid_constant__ wl_tmap tq, const __grid_constant__ wl_tmap tk,                     \
             const __grid_constant__ wl_tmap tv, const __grid_constant__ wl_tmap tk_t,                                 \
             const __grid_constant__ wl_tmap tv_t, const __grid_constant__ wl_tmap tk_h,                               \
             const __grid_constant__ wl_tmap tv_h, const wl_bf16* gate, int mix, const float* coarse,                  \
             const int* kept, vsa_grid qg, vsa_grid kg, int nq, int heads, int top_k, float scale) {                   \
        vsa_fine_tma<PERSIST, TRIM, EXACT>(out, &tq, &tk, &tv, &tk_t, &tv_t, &tk_h, &tv_h, gate, mix, coarse, kept,   \
                                           qg, kg, nq, heads, top_k, scale);                                           \
    }
WL_VSA_FINE_TMA(vsa_fine_tma_bf16_d128, false, true, false)
WL_VSA_FINE_TMA(vsa_fine_tma_persist_bf16_d128, true, true, false)
WL_VSA_FINE_TMA(vsa_fine_tma_persist_rows_bf16_d128, true, false, false)
WL_VSA_FINE_TMA(vsa_fine_tma_persist_exact_bf16_d128, true, true, true)

#endif
