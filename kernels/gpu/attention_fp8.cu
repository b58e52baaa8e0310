// fp8 attention over a KV cache: e4m3 operands on Hopper's wgmma, f32 accumulation. Compiled as
// part of the attention unit (gpu_source.rs appends this file to attention.cu), so it shares
// fw_softmax, fw_split and the split-combine kernel.
//
// Scaling: one scale per (tile of 128 rows, head) for q, k and v, amax / 448 over the tile. q
// and k come out of RMSNorm (every token at the same RMS) and e4m3 is a float format, so a
// per-tile scale keeps each value's relative precision as a per-token one would; in exchange
// the softmax step costs what the bf16 kernel's does (no per-key multiply):
//  - the k tile's scale folds into the tile's score scale;
//  - P is quantized as w = 448·p·(vs_j / vmax) (the gain in the exponent, free): each v tile's
//    scale relative to the largest of the item's tiles, so the output accumulates in one unit
//    and is rescaled only when a row's maximum moves.
//
// Layout of the fp8 store (`Fp8Kv` in kernels/src/fp8_attention.rs), `cap` keys (a multiple of
// 128), per head h:
//   k8 [cap, heads, 128] codes, as k;          ks [heads, cap / 128] tile scales;
//   vt [heads, 128, cap] codes, V transposed;  vs [heads, cap / 128] tile scales.
// wgmma takes fp8 operands only K-major, so P·V needs V with keys contiguous per dim (Vᵀ). And
// within each group of 32 keys, Vᵀ holds key `fp8_vt_key(slot)` at `slot`: the order in which the
// score accumulators of a thread already sit in the A-operand layout of an e4m3 wgmma, so P goes
// from the S = Q·Kᵀ accumulators into P·V's registers without a shuffle.

#define F8_TILE 128

// The key held at `slot` of a 32-key group of Vᵀ. A thread of the m64nNk32 e4m3 A fragment holds
// k = 4t..4t+3 and 16+4t..16+4t+3 (t = lane % 4); the f32 accumulators of S hold columns 2t, 2t+1,
// 8+2t, 9+2t (and the same + 16).
WL_DEVICE int fp8_vt_key(int slot) {
    const int half = slot & 16, p = slot & 15, t = p >> 2, i = p & 3;
    return half + 2 * t + (i & 1) + ((i >> 1) << 3);
}

// The largest |x| over rows [r0, r1) of head h of x [rows, heads, 128], by the whole block, on
// 16-byte vectors (a row is 128 / N of them).
template <typename T>
WL_DEVICE float fp8_tile_amax(const T* x, int r0, int r1, int heads, int h, float* scratch) {
    constexpr int N = WlVec<T>::N, V = 128 / N;
    float a = 0.0f;
    for (int u = threadIdx.x; u < (r1 - r0) * V; u += blockDim.x) {
        float v[N];
        WlVec<T>::load(v, x + ((wl_u64)(r0 + u / V) * heads + h) * 128, u % V);
#pragma unroll
        for (int c = 0; c < N; ++c) a = fmaxf(a, fabsf(v[c]));
    }
    return wl_block_max(a, scratch);
}

// Codes of rows [r0, r0 + 128) of head h (zeros past r1) into codes [.., heads, 128], and the
// tile's scale into scales[h * tiles + tile]. wl_pack_e4m3_lean gives wl_to_e4m3's codes.
template <typename T>
WL_DEVICE void fp8_tile_rows(unsigned char* codes, float* scales, const T* x, int r0, int r1, int heads, int h,
                             int tiles, float* scratch) {
    constexpr int N = WlVec<T>::N, V = 128 / N;
    const float s = fmaxf(fp8_tile_amax(x, r0, r1, heads, h, scratch) / 448.0f, 1e-12f), inv = 1.0f / s;
    for (int u = threadIdx.x; u < F8_TILE * V; u += blockDim.x) {
        const int r = r0 + u / V, j = u % V;
        const wl_u64 row = ((wl_u64)r * heads + h) * 128;
        float v[N] = {};
        if (r < r1) WlVec<T>::load(v, x + row, j);
        if constexpr (N == 8)
            ((uint2*)(codes + row))[j] = make_uint2(wl_pack_e4m3_lean(v, inv), wl_pack_e4m3_lean(v + 4, inv));
        else
            ((unsigned int*)(codes + row))[j] = wl_pack_e4m3_lean(v, inv);
    }
    if (threadIdx.x == 0) scales[h * tiles + r0 / F8_TILE] = s;
}

// Queries [lq, heads, 128] as codes and [heads, ceil(lq / 128)] tile scales: a block per
// (tile, head). The codes buffer holds whole tiles (rows up to a multiple of 128).
template <typename T>
WL_DEVICE void fp8_q_tiles(unsigned char* codes, float* scales, const T* q, int lq, int heads) {
    __shared__ float scratch[32];
    const int r0 = blockIdx.x * F8_TILE;
    fp8_tile_rows(codes, scales, q, r0, min(lq, r0 + F8_TILE), heads, blockIdx.y, gridDim.x, scratch);
}

// Requantizes key tiles tile0 + blockIdx.x of the store from the whole k, v [≥ valid, heads, 128]
// (keys at or past `valid` become zeros): a block per (tile, head). V's codes are transposed
// through shared memory so that the writes to Vᵀ go out as 128-byte rows.
template <typename T>
WL_DEVICE void fp8_kv_store(unsigned char* k8, float* ks, unsigned char* vt, float* vs, const T* k, const T* v,
                            int heads, int valid, int tile0, int cap) {
    __shared__ float scratch[32];
    // Rows 16 bytes longer than a tile's keys, 16-byte aligned (declared as uint4) for the copy
    // out.
    __shared__ uint4 tile_words[128][(F8_TILE + 16) / 16];
    unsigned char (*tile)[F8_TILE + 16] = (unsigned char (*)[F8_TILE + 16])tile_words;
    const int h = blockIdx.y, r0 = (tile0 + blockIdx.x) * F8_TILE, r1 = min(valid, r0 + F8_TILE);
    const int tiles = cap / F8_TILE;
    fp8_tile_rows(k8, ks, k, r0, r1, heads, h, tiles, scratch);
    constexpr int N = WlVec<T>::N, V = 128 / N;
    const float s = fmaxf(fp8_tile_amax(v, r0, r1, heads, h, scratch) / 448.0f, 1e-12f), inv = 1.0f / s;
    for (int u = threadIdx.x; u < F8_TILE * V; u += blockDim.x) {
        const int key = u / V, d0 = (u % V) * N, r = r0 + key;
        // Key `key` goes to the slot of its 32-group whose fp8_vt_key it is.
        const int q = key & 15, slot = (key & ~15) | (((q & 7) >> 1) << 2) | (q & 1) | ((q >> 3) << 1);
        float x[N] = {};
        if (r < r1) WlVec<T>::load(x, v + ((wl_u64)r * heads + h) * 128, u % V);
#pragma unroll
        for (int c = 0; c < N; c += 4) {
            const unsigned int w = wl_pack_e4m3_lean(x + c, inv);
#pragma unroll
            for (int b = 0; b < 4; ++b) tile[d0 + c + b][slot] = (unsigned char)(w >> (8 * b));
        }
    }
    if (threadIdx.x == 0) vs[h * tiles + r0 / F8_TILE] = s;
    __syncthreads();
    // 16 bytes a thread: a dim's 128 keys are 8 such pieces.
    for (int u = threadIdx.x; u < 128 * (F8_TILE / 16); u += blockDim.x) {
        const int d = u / (F8_TILE / 16), piece = u % (F8_TILE / 16);
        *(uint4*)(vt + ((wl_u64)h * 128 + d) * cap + r0 + piece * 16) = *(const uint4*)(&tile[d][piece * 16]);
    }
}

#define WL_FP8_TILES(T, SUF)                                                                                       \
    WL_KERNEL void fp8_q_tiles_##SUF(unsigned char* codes, float* scales, const T* q, int lq, int heads) {        \
        fp8_q_tiles(codes, scales, q, lq, heads);                                                                  \
    }                                                                                                              \
    WL_KERNEL void fp8_kv_store_##SUF(unsigned char* k8, float* ks, unsigned char* vt, float* vs, const T* k,       \
                                      const T* v, int heads, int valid, int tile0, int cap) {                     \
        fp8_kv_store(k8, ks, vt, vs, k, v, heads, valid, tile0, cap);                                              \
    }
WL_FP8_TILES(float, f32)
WL_FP8_TILES(wl_bf16, bf16)

#if defined(WL_HAS_MFMA_FP8)
// The same attention on CDNA3/4 matrix cores (v_mfma_f32_16x16x32_fp8_fp8; gfx950's OCP e4m3 is
// our codes, gfx94x's fnuz takes them as codes of half the value, f8m_device below),
// laid out as attention.cu's bf16 MFMA kernel with eight elements of K a lane: Sᵀ = K·Qᵀ keeps a
// query's softmax state in one lane, and its probabilities, as e4m3, are the B operand of
// Oᵀ = Vᵀ·Pᵀ. A block of 4 wavefronts takes one 128-query tile of one head, so q's tile scale is
// the block's; a staged tile of 64 keys lies in one 128-key tile, so k's scale joins the step's
// score scale, and P is quantized as the Hopper kernel's w = 448·p·(vs_j / vmax). Vᵀ is staged
// from the store's Hopper order (fp8_vt_key) into the one this operand reads (fm_vt_pos<8>).
// Never run on an AMD GPU (checked on the CPU emulation of kernels/tests/rocm_emu).
#define F8M_KP (128 + 16)
#define F8M_VP (FM_BC + 16)

#if defined(WL_MFMA_FP8_FNUZ)
// Our e4m3fn code as the matrix cores' fnuz code of half its value: the same bits (exponent bias
// 8 against 7), but for -0 (0x80, fnuz's NaN) → 0 and NaN (S.1111.111) → 0x80. Products of two
// such operands are a quarter of ours: F8M_UNIT² undoes it.
WL_DEVICE unsigned char f8m_device(unsigned char c) {
    return c == 0x80 ? 0 : (c & 0x7f) == 0x7f ? 0x80 : c;
}
#define F8M_UNIT 2.0f
#else
WL_DEVICE unsigned char f8m_device(unsigned char c) { return c; }
#define F8M_UNIT 1.0f
#endif
// Eight codes at once (byte i is element i).
WL_DEVICE unsigned long long f8m_device8(unsigned long long w) {
    unsigned long long r = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) r |= (unsigned long long)f8m_device((unsigned char)(w >> (8 * i))) << (8 * i);
    return r;
}
WL_DEVICE uint4 f8m_device16(uint4 w) {
    const unsigned long long lo = f8m_device8(w.x | ((unsigned long long)w.y << 32));
    const unsigned long long hi = f8m_device8(w.z | ((unsigned long long)w.w << 32));
    return make_uint4((unsigned int)lo, (unsigned int)(lo >> 32), (unsigned int)hi, (unsigned int)(hi >> 32));
}

// Stages keys [first, first + count) of head h: K codes row-major, Vᵀ codes permuted; zeros past
// count. The whole block takes part; the caller syncs after.
WL_DEVICE void f8m_stage(unsigned char* ks, unsigned char* vt, const unsigned char* k8, const unsigned char* vt8,
                         int first, int count, int heads, int h, int cap) {
    for (int i = threadIdx.x; i < FM_BC * 8; i += blockDim.x) {
        const int r = i / 8, c16 = (i % 8) * 16;
        uint4 w = make_uint4(0, 0, 0, 0);
        if (r < count) w = f8m_device16(*(const uint4*)(k8 + ((wl_u64)(first + r) * heads + h) * 128 + c16));
        *(uint4*)(ks + r * F8M_KP + c16) = w;
    }
    for (int i = threadIdx.x; i < 128 * (FM_BC / 16); i += blockDim.x) {
        const int d = i / (FM_BC / 16), s0 = (i % (FM_BC / 16)) * 16;
        const uint4 w = *(const uint4*)(vt8 + ((wl_u64)h * 128 + d) * cap + first + s0);
        const unsigned int ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int b = 0; b < 16; ++b) {
            const int slot = s0 + b, key = (slot & ~31) | fp8_vt_key(slot & 31);
            const unsigned char c = key < count ? f8m_device((unsigned char)(ws[b / 4] >> (8 * (b % 4)))) : 0;
            vt[d * F8M_VP + fm_vt_pos<8>(key)] = c;
        }
    }
}

WL_DEVICE wl_fp8x8 f8m_load(const unsigned char* p) {
    wl_fp8x8 r;
    __builtin_memcpy(&r, p, sizeof r);
    return r;
}

WL_KERNEL void __launch_bounds__(64 * FM_WAVES)
    flash_fp8_mfma_d128(wl_bf16* out, const unsigned char* q8, const float* qs, const unsigned char* k8,
                        const float* ksc, const unsigned char* vt8, const float* vsc, int lq, int kv_len, int heads,
                        int cap, float scale) {
    __align__(16) __shared__ unsigned char ks[FM_BC * F8M_KP];
    __align__(16) __shared__ unsigned char vt[128 * F8M_VP];
    __shared__ float scratch[32];
    const int wave = threadIdx.x / 64, lane = threadIdx.x % 64;
    const int col = lane % 16, grp = lane / 16;
    const int tile = blockIdx.x, h = blockIdx.y, k_tiles = cap / F8_TILE;
    const wl_u64 row = (wl_u64)heads * 128;
    // The largest v tile scale of the keys attended: P's unit.
    float vm = 0.0f;
    for (int j = threadIdx.x; j < (kv_len + F8_TILE - 1) / F8_TILE; j += blockDim.x) vm = fmaxf(vm, vsc[h * k_tiles + j]);
    const float vmax = fmaxf(wl_block_max(vm, scratch), 1e-30f);
    const float sq = qs[h * gridDim.x + tile];
    int qi[2];
    wl_fp8x8 qf[2][4];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        // The codes hold whole tiles (zeros past lq).
        qi[hh] = tile * F8_TILE + wave * 32 + hh * 16 + col;
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            unsigned long long w;
            __builtin_memcpy(&w, q8 + (wl_u64)qi[hh] * row + (wl_u64)h * 128 + kk * 32 + grp * 8, sizeof w);
            w = f8m_device8(w);
            __builtin_memcpy(&qf[hh][kk], &w, sizeof w);
        }
    }
    FmState st;
    fm_init(st);
    for (int kb = 0; kb < kv_len; kb += FM_BC) {
        f8m_stage(ks, vt, k8, vt8, kb, min(FM_BC, kv_len - kb), heads, h, cap);
        __syncthreads();
        const int kt = h * k_tiles + kb / F8_TILE;
        wl_f32x4 s[2][FM_BC / 16];
#pragma unroll
        for (int t = 0; t < FM_BC / 16; ++t) {
#pragma unroll
            for (int hh = 0; hh < 2; ++hh)
#pragma unroll
                for (int e = 0; e < 4; ++e) s[hh][t][e] = 0.0f;
#pragma unroll
            for (int kk = 0; kk < 4; ++kk) {
                const wl_fp8x8 a = f8m_load(ks + (t * 16 + col) * F8M_KP + kk * 32 + grp * 8);
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) s[hh][t] = wl_mfma_16x16x32_fp8(a, qf[hh][kk], s[hh][t]);
            }
        }
        const int vis[2] = {kv_len - kb, kv_len - kb};
        fm_softmax(st, s, vis, scale * 1.4426950408889634f * sq * ksc[kt] * (F8M_UNIT * F8M_UNIT), grp);
        // P as e4m3 in units of vmax / 448: two score blocks' probabilities make a lane's eight.
        const float g = 448.0f * vsc[kt] / vmax;
#pragma unroll
        for (int t2 = 0; t2 < FM_BC / 32; ++t2) {
            wl_fp8x8 p[2];
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
                const float w[8] = {s[hh][2 * t2][0],     s[hh][2 * t2][1],     s[hh][2 * t2][2],
                                    s[hh][2 * t2][3],     s[hh][2 * t2 + 1][0], s[hh][2 * t2 + 1][1],
                                    s[hh][2 * t2 + 1][2], s[hh][2 * t2 + 1][3]};
                const unsigned long long lo = wl_pack_e4m3_lean(w, g), hi = wl_pack_e4m3_lean(w + 4, g);
                const unsigned long long both = f8m_device8(lo | (hi << 32));
                __builtin_memcpy(&p[hh], &both, sizeof both);
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const wl_fp8x8 a = f8m_load(vt + (j * 16 + col) * F8M_VP + t2 * 32 + grp * 8);
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) st.o[hh][j] = wl_mfma_16x16x32_fp8(a, p[hh], st.o[hh][j]);
            }
        }
        // The tile is restaged next: everyone must be done reading it.
        __syncthreads();
    }
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const float inv = fm_inv_sum(st, hh) * vmax / 448.0f * (F8M_UNIT * F8M_UNIT);
        if (qi[hh] >= lq) continue;
        wl_bf16* dst = out + (wl_u64)qi[hh] * row + (wl_u64)h * 128 + grp * 4;
#pragma unroll
        for (int j = 0; j < 8; ++j)
            *(uint2*)(dst + j * 16) = make_uint2(wl_pack_bf16(st.o[hh][j][0] * inv, st.o[hh][j][1] * inv),
                                                 wl_pack_bf16(st.o[hh][j][2] * inv, st.o[hh][j][3] * inv));
    }
}
#endif

#if defined(WL_HAS_WGMMA)
// The dense TMA kernel of attention.cu with e4m3 operands: the same producer / two ping-ponging
// consumers and the same tail split, 128 keys a tile. Per tile a K tile (128 keys × 128 dims) and
// a Vᵀ tile (128 dims × 128 keys) of 16 KiB each, so a stage is half the bf16 kernel's.
template <int ST>
WL_DEVICE void flash_fp8_d128(wl_bf16* out, const wl_tmap* tq, const wl_tmap* tk, const wl_tmap* tv,
                              const float* qscale, const float* ks, const float* vs, int lq, int kv_len, int heads,
                              int cap, float scale, fw_split sp) {
    constexpr int TB = F8_TILE * 128, SB = 2 * TB;
    extern __shared__ __align__(1024) unsigned char f8_smem[];
    unsigned char* qsm = f8_smem;
    unsigned char* stages = f8_smem + FW_BR * 128;
    unsigned long long* full = (unsigned long long*)(stages + ST * SB);
    unsigned long long* empty = full + ST;
    unsigned long long* qbar = empty + ST;
    // The warpgroup index through a shuffle, so the compiler keeps what derives from it uniform
    // (see vsa_fine_tma in attention.cu).
    const int wg = wl_shfl((int)(threadIdx.x / 128), 0), t = threadIdx.x % 128, lane = t % 32;
    const int nqb = (lq + FW_BR - 1) / FW_BR;
    int item = blockIdx.x, part = -1;
    if (item >= sp.whole) part = (item - sp.whole) % sp.parts, item = sp.whole + (item - sp.whole) / sp.parts;
    const int h = item / nqb, qb = item % nqb * FW_BR;
    const int tiles = (kv_len + F8_TILE - 1) / F8_TILE;
    const int j0 = part < 0 ? 0 : part * tiles / sp.parts;
    const int n = part < 0 ? tiles : (part + 1) * tiles / sp.parts - j0;
    if (threadIdx.x == 0) {
        for (int s = 0; s < ST; ++s) wl_mbar_init(full + s, 1), wl_mbar_init(empty + s, 2);
        wl_mbar_init(qbar, 1);
        wl_mbar_init_fence();
    }
    __syncthreads();
    if (wg == 2) {
        WL_SETMAXNREG_DEC(40);
        if (t == 0) {
            wl_mbar_expect_tx(qbar, FW_BR * 128);
            wl_tma_load_3d(qsm, tq, 0, h, qb, qbar);
            for (int j = 0; j < n; ++j) {
                const int s = j % ST;
                if (j >= ST) wl_mbar_wait(empty + s, (j / ST - 1) & 1);
                unsigned char* st = stages + s * SB;
                const int key = (j0 + j) * F8_TILE;
                wl_mbar_expect_tx(full + s, SB);
                wl_tma_load_3d(st, tk, 0, h, key, full + s);
                wl_tma_load_3d(st + TB, tv, key, 0, h, full + s);
            }
        }
        return;
    }
    WL_SETMAXNREG_INC(232);
    const int row0 = qb + wg * 64 + (t / 32) * 16 + lane / 4;  // and row0 + 8
    const int cq = (lane % 4) * 2;
    const int ntiles = cap / F8_TILE;
    const float* ksh = ks + (wl_u64)h * ntiles;
    const float* vsh = vs + (wl_u64)h * ntiles;
    // The score scale of the block's query tile, in log2 units; per key tile times its k scale.
    const float qs2 = scale * 1.4426950408889634f * qscale[(wl_u64)h * nqb + qb / FW_BR];
    // P is quantized as 448·p: e4m3's largest value for the row's largest weight.
    const float gain = 8.807354922057604f;  // log2(448)
    // Descriptors of this warpgroup's Q rows and of stage 0's K and Vᵀ; the others are fixed
    // offsets from these.
    const unsigned long long dq = wl_wgmma_desc_sw128(qsm + wg * 64 * 128);
    const unsigned long long dk0 = wl_wgmma_desc_sw128(stages), dv0 = wl_wgmma_desc_sw128(stages + TB);
    auto scores = [&](float* sc, int s) {
        const unsigned long long dk = wl_desc_plus(dk0, s * SB);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
            wl_wgmma_64x128x32_e4m3_ss(sc, wl_desc_plus(dq, kk * 32), wl_desc_plus(dk, kk * 32), kk);
    };
    auto pv = [&](float* o, const unsigned int (*pa)[4], int s) {
        const unsigned long long dv = wl_desc_plus(dv0, s * SB);
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) wl_wgmma_64x128x32_e4m3_rs(o, pa[kk], wl_desc_plus(dv, kk * 32));
    };
    // The weights as e4m3 in the A-fragment order of P·V (see fp8_vt_key): byte i of register
    // r holds accumulator columns 2t, 2t+1, 8+2t, 9+2t of row e (r = e, and + 2 for the next 16).
    auto pack = [](unsigned int (*pa)[4], const float* s) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
#pragma unroll
            for (int r = 0; r < 4; ++r) {
                const int j = 4 * kk + (r >> 1) * 2, e = r & 1;
                pa[kk][r] = wl_cvt_e4m3x2(s[4 * j + 2 * e], s[4 * j + 2 * e + 1]) |
                            (wl_cvt_e4m3x2(s[4 * j + 4 + 2 * e], s[4 * j + 4 + 2 * e + 1]) << 16);
            }
    };
    // Each tile's P·V adds P_j · codes(V_j) with P_j = 448·p·r_j, r_j = vs_j / vmax ≤ 1 (vmax the
    // largest v scale of this item's tiles): the output accumulates in units of vmax / 448 for
    // every tile, so it is rescaled only when a row's maximum moves, as in the bf16 kernel. r_j
    // enters the exponent with the 448; the row sums take 1 / r_j back out, so they count p.
    float vmax = 0.0f;
    for (int u = lane; u < n; u += 32) vmax = fmaxf(vmax, vsh[j0 + u]);
#pragma unroll
    for (int x = 16; x > 0; x >>= 1) vmax = fmaxf(vmax, wl_shfl_xor(vmax, x));
    const float gain_v = gain - __log2f(vmax);  // log2(448 / vmax): add log2(vs_j) per tile
    float o[64];
#pragma unroll
    for (int j = 0; j < 64; ++j) o[j] = 0.0f;
    float m[2] = {-WL_INF, -WL_INF}, l[2] = {0.0f, 0.0f};
    unsigned int pa[4][4];
    wl_mbar_wait(qbar, 0);
    wl_mbar_wait(full, 0);
    if (wg == 1) wl_named_arrive(1, 256);
    {
        float sc[64];
        wl_named_sync(1 + wg, 256);
        wl_wgmma_fence();
        scores(sc, 0);
        wl_wgmma_commit();
        wl_named_arrive(2 - wg, 256);
        wl_wgmma_wait_all();
        float nm[2], corr[2], sum[2];
        const float v = vsh[j0];
        fw_softmax<F8_TILE>(sc, m, nm, corr, sum, j0 * F8_TILE, row0, cq, kv_len, 0, qs2 * ksh[j0],
                            gain_v + __log2f(v));
        const float unr = __fdividef(vmax, v);
#pragma unroll
        for (int e = 0; e < 2; ++e) m[e] = nm[e], l[e] = sum[e] * unr;
        pack(pa, sc);
    }
    auto step = [&](int j, bool mask) {
        const int s = j % ST, prev = (j - 1) % ST;
        const float kscale = ksh[j0 + j], v = vsh[j0 + j];
        wl_mbar_wait(full + s, (j / ST) & 1);
        float sc[64];
        wl_named_sync(1 + wg, 256);
        wl_wgmma_fence();
        scores(sc, s);
        wl_wgmma_commit();
        pv(o, pa, prev);
        wl_wgmma_commit();
        wl_named_arrive(2 - wg, 256);
        wl_wgmma_wait_one();
        float nm[2], corr[2], sum[2];
        const int kb = (j0 + j) * F8_TILE;
        const float g = gain_v + __log2f(v);
        if (mask) fw_softmax<F8_TILE, true>(sc, m, nm, corr, sum, kb, row0, cq, kv_len, 0, qs2 * kscale, g);
        else fw_softmax<F8_TILE, false>(sc, m, nm, corr, sum, kb, row0, cq, kv_len, 0, qs2 * kscale, g);
        wl_wgmma_wait_all();
        if (t == 0) wl_mbar_arrive(empty + prev);
        const float unr = __fdividef(vmax, v);
#pragma unroll
        for (int e = 0; e < 2; ++e) sum[e] *= unr;
        fw_rescale(o, m, l, nm, corr, sum);
        pack(pa, sc);
    };
    const int jm = max(1, min(n, fw_first_masked(qb, kv_len, 0, F8_TILE) - j0));
    for (int j = 1; j < jm; ++j) step(j, false);
    for (int j = jm; j < n; ++j) step(j, true);
    if (wg == 0) wl_named_sync(1, 256);
    wl_wgmma_fence();
    pv(o, pa, (n - 1) % ST);
    wl_wgmma_commit();
    wl_wgmma_wait_all();
    // Outputs leave in real units (times vmax), so split parts merge as the bf16 kernel's do
    // (their sums carry the same 448 as their outputs).
    fw_finish(o, m, l, vmax, out, sp, item, part, qb, row0, cq, lq, heads, h);
}

// q as [lq, heads, 128] codes and k as [cap, heads, 128], in boxes of 128 dims × 1 head × 128
// rows; vt as [heads, 128, cap] in boxes of 128 keys × 128 dims.
#define WL_FLASH_FP8(ST)                                                                                        \
    WL_KERNEL void __launch_bounds__(FT_THREADS, 1) flash_fp8_d128_s##ST(                                       \
        wl_bf16* out, const __grid_constant__ wl_tmap tq, const __grid_constant__ wl_tmap tk,                  \
        const __grid_constant__ wl_tmap tv, const float* qscale, const float* ks, const float* vs, int lq,     \
        int kv_len, int heads, int cap, float scale, fw_split sp) {                                           \
        flash_fp8_d128<ST>(out, &tq, &tk, &tv, qscale, ks, vs, lq, kv_len, heads, cap, scale, sp);             \
    }
// Shared memory: 16 KiB of Q, then ST stages of 32 KiB, then the barriers.
WL_FLASH_FP8(4)
WL_FLASH_FP8(6)
#endif
