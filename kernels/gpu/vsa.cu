// Video sparse attention (kernels/src/vsa.rs has the definition and the CPU reference), in
// portable kernels: the tiling, tile means, the coarse branch with the top-k selection, and the
// fine branch over the kept tiles. Tokens stay in grid order; the tiling is index arrays
// (`order`: grid index of each tiled position, `offsets`/`sizes` per tile), written on the device,
// so no permuted copies are made. The fine kernel here is the correctness-first one (one warp per
// query and head, like the portable attention kernel); the vendor modules have the tensor-core
// ones.
//
// The means and the coarse scores reproduce the CPU's arithmetic bit for bit (f32 sums in token
// order; f32 dot products in element order, each step one fused multiply-add), so the top-k
// selection is the CPU's on every input, not only away from near-ties.

#define WL_VSA_MAX_D 256
#define WL_VSA_WARPS 4
// Threads of a means block; each sums one 16-byte column slice of a tile's rows.
#define WL_VSA_MEAN_THREADS 128
// Tokens whose loads a means thread issues before adding any of them.
#define WL_VSA_MEAN_BATCH 8
#define WL_VSA_COARSE_THREADS 256

// A token grid of gt × gh × gw in 4×4×4 tiles (vsa.rs's Tiling): tiles walk t → h → w, and so
// do the tokens inside a tile. Tile j's origin (t0, h0, w0) and extent (lt, lh, lw).
struct vsa_tile {
    int t0, h0, w0, lt, lh, lw;
};
WL_DEVICE vsa_tile vsa_tile_of(int j, int gt, int gh, int gw) {
    const int nh = (gh + 3) / 4, nw = (gw + 3) / 4;
    vsa_tile r;
    r.t0 = j / (nh * nw) * 4;
    r.h0 = j / nw % nh * 4;
    r.w0 = j % nw * 4;
    r.lt = min(4, gt - r.t0);
    r.lh = min(4, gh - r.h0);
    r.lw = min(4, gw - r.w0);
    return r;
}
// The tiling of a gt × gh × gw grid as vsa.rs's Tiling builds it, written on the device (no
// upload between launches): a thread per tile j, which writes its size, its offset (the tokens
// of the earlier time slabs, of the earlier rows of tiles in its slab, of the earlier tiles in
// its row) and the grid index of each of its tokens in t → h → w order.
WL_KERNEL void vsa_tiling(int* order, int* offsets, int* sizes, int gt, int gh, int gw, int tiles) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= tiles) return;
    const vsa_tile b = vsa_tile_of(j, gt, gh, gw);
    const int first = b.t0 * gh * gw + b.h0 * b.lt * gw + b.w0 * b.lt * b.lh;
    offsets[j] = first;
    sizes[j] = b.lt * b.lh * b.lw;
    int p = first;
    for (int t = 0; t < b.lt; ++t)
        for (int y = 0; y < b.lh; ++y)
            for (int x = 0; x < b.lw; ++x) order[p++] = ((b.t0 + t) * gh + b.h0 + y) * gw + b.w0 + x;
}

// Where key tile j's mean of element e of head h lies in the coarse kernel's layout: for each
// head and group of four elements, the float4s of every key tile in turn
// ([heads, ⌈d/4⌉, nk, 4]), so that a warp scoring 32 consecutive key tiles reads 512
// contiguous bytes per load, where rows of [nk, heads, d] are heads · d · 4 bytes apart (a line
// a lane: L1 at 77 % of its throughput, the kernel waiting on those loads; Nsight Compute, H100,
// 2026-12-06).
WL_DEVICE wl_u64 vsa_kt(int j, int h, int e, int nk, int d) {
    return (((wl_u64)h * ((d + 3) / 4) + e / 4) * nk + j) * 4 + e % 4;
}

// Rows of x are 16-byte aligned when its base is and a row is whole 16-byte vectors.
template <typename T>
WL_DEVICE bool vsa_vector_rows(const T* x, wl_u64 row) {
    return row % (16 / sizeof(T)) == 0 && ((wl_u64)x & 15) == 0;
}

// acc[0 .. V) += columns c .. c + V of the n rows at src(0), ..., src(n - 1) of x, added in that
// order in f32. Where rows are whole 16-byte vectors, the loads of a batch of rows are all issued
// before any is added, so a thread keeps 128 bytes in flight; else element loads, the columns
// past `row` left out.
template <typename T, typename Src>
WL_DEVICE void vsa_add_rows(float* acc, const T* x, wl_u64 row, wl_u64 c, int n, Src src) {
    constexpr int V = 16 / sizeof(T);
    if (vsa_vector_rows(x, row)) {
        for (int p = 0; p < n; p += WL_VSA_MEAN_BATCH) {
            uint4 raw[WL_VSA_MEAN_BATCH];
            for (int b = 0; b < WL_VSA_MEAN_BATCH; ++b)
                if (p + b < n) raw[b] = *(const uint4*)src(p + b);
            for (int b = 0; b < WL_VSA_MEAN_BATCH; ++b) {
                if (p + b < n) {
                    float f[V];
                    wl_unpack16(f, raw[b], x);
                    for (int u = 0; u < V; ++u) acc[u] += f[u];
                }
            }
        }
        return;
    }
    for (int p = 0; p < n; ++p) {
        const T* s = src(p);
        for (int u = 0; u < V; ++u)
            if (c + u < row) acc[u] += wl_ld(s, u);
    }
}

// out[j, c] = mean over tile j's positions p of x[order[p], c], for this block's slice of the
// `row` = heads · d columns. Every thread owns 16 bytes of columns and adds the tile's tokens in
// order in f32, as the CPU does, so the means are the CPU's to the bit; a tile's tokens are whole
// rows of heads · d, so a warp reads contiguous 512 bytes per token. The loads of a batch of
// tokens are all issued before any is added, so a thread keeps 128 bytes in flight: the kernel is
// bound by memory, not by its adds (f64 sums, as before, were bound by the f32 → f64 conversions,
// 16 a clock per SM on Hopper).
template <typename T>
WL_DEVICE void vsa_mean_slice(float* out, const T* x, const int* order, int j, int first, int n, wl_u64 row,
                              wl_u64 c0, int tnk = 0, int td = 0) {
    constexpr int V = 16 / sizeof(T);
    const wl_u64 c = c0 + (wl_u64)threadIdx.x * V;
    if (c >= row) return;
    const bool vec = vsa_vector_rows(x, row);
    float acc[V];
    for (int u = 0; u < V; ++u) acc[u] = 0.0f;
    vsa_add_rows(acc, x, row, c, n, [&](int p) { return x + (wl_u64)order[first + p] * row + c; });
    const float fn = (float)n;
    if (td > 0) {
        // Key means in the coarse kernel's layout (vsa_kt), an element at a time.
        for (int u = 0; u < V; ++u)
            if (c + u < row) out[vsa_kt(j, (int)((c + u) / td), (int)((c + u) % td), tnk, td)] = acc[u] / fn;
        return;
    }
    float* dst = out + (wl_u64)j * row + c;
    if (vec) {
        // 16-byte stores: c is a multiple of V ≥ 4 floats, and the buffer is 16-byte aligned.
        for (int u = 0; u < V; u += 4) {
            float4 w;
            w.x = acc[u] / fn;
            w.y = acc[u + 1] / fn;
            w.z = acc[u + 2] / fn;
            w.w = acc[u + 3] / fn;
            *(float4*)(dst + u) = w;
        }
    } else {
        for (int u = 0; u < V; ++u)
            if (c + u < row) dst[u] = acc[u] / fn;
    }
}

// Tile job's means over column slice `slice` of the row (WL_VSA_MEAN_THREADS × 16 bytes a
// slice), from its tiling's offsets and sizes.
template <typename T>
WL_DEVICE void vsa_mean_job(float* out, const T* x, const int* order, const int* offsets, const int* sizes, int job,
                            int slice, wl_u64 row, int tnk = 0, int td = 0) {
    const wl_u64 c0 = (wl_u64)slice * WL_VSA_MEAN_THREADS * (16 / sizeof(T));
    vsa_mean_slice(out, x, order, job, offsets[job], sizes[job], row, c0, tnk, td);
}

// The means of q (its tiling) and of k and v (the key tiling) in one launch: block b is column
// slice b % chunks of tile job b / chunks, the q tiles first, then k's, then v's.
template <typename T>
WL_DEVICE void vsa_tile_means(float* qm, float* km, float* vm, const T* q, const T* k, const T* v, const int* q_order,
                              const int* q_offsets, const int* q_sizes, const int* k_order, const int* k_offsets,
                              const int* k_sizes, int nq, int nk, int row, int chunks, int d) {
    int job = blockIdx.x / chunks;
    const int slice = blockIdx.x % chunks;
    if (job < nq) {
        vsa_mean_job(qm, q, q_order, q_offsets, q_sizes, job, slice, row);
        return;
    }
    job -= nq;
    if (job < nk)
        vsa_mean_job(km, k, k_order, k_offsets, k_sizes, job, slice, row, nk, d);
    else
        vsa_mean_job(vm, v, k_order, k_offsets, k_sizes, job - nk, slice, row);
}

// Sums of each frame's 1×4×4 slabs (edge slabs partial) of x from token row `first` on, frames
// of gh × gw tokens: out[(f·nh + bh)·nw + bw, c], the slab's tokens added in row-major order
// from 0, as vsa.rs's frame_sums (what a KV cache keeps so that key-tile means need not read
// it). A thread per 16 bytes of the `row` = heads · d columns; block b is column slice
// b % chunks of slab b / chunks. The adds go through vsa_add_rows as the tile means' do (until
// 2026-12-07 element loads a token at a time). Nsight Compute on an H100 (2026-12-07): 87 % of
// DRAM's peak over an 18-frame window, 59 % over a 3-frame chunk (26 µs, a third of it the
// launch's fixed cost).
template <typename T>
WL_DEVICE void vsa_frame_sums(float* out, const T* x, wl_u64 first, int gh, int gw, wl_u64 row, int chunks) {
    constexpr int V = 16 / sizeof(T);
    const int slab = blockIdx.x / chunks;
    const wl_u64 c = (wl_u64)(blockIdx.x % chunks) * WL_VSA_MEAN_THREADS * V + (wl_u64)threadIdx.x * V;
    if (c >= row) return;
    const int nh = (gh + 3) / 4, nw = (gw + 3) / 4;
    const int f = slab / (nh * nw), y0 = slab / nw % nh * 4, x0 = slab % nw * 4;
    const int ny = min(y0 + 4, gh) - y0, nx = min(x0 + 4, gw) - x0, n = ny * nx;
    // Token p of the slab (row-major) at row `first + (f·gh + y)·gw + xx` of x.
    auto src = [&](int p) { return x + (first + ((wl_u64)f * gh + y0 + p / nx) * gw + x0 + p % nx) * row + c; };
    float acc[V];
    for (int u = 0; u < V; ++u) acc[u] = 0.0f;
    vsa_add_rows(acc, x, row, c, n, src);
    float* dst = out + (wl_u64)slab * row + c;
    for (int u = 0; u < V; ++u)
        if (c + u < row) dst[u] = acc[u];
}

// Key-tile means from frame sums (vsa_frame_sums' rows): tile j's mean adds the slab sums of its
// frames in frame order from 0, then divides by its token count, as vsa.rs's means_from_sums. A
// thread per `per` columns (4, one float4, where a head's row is whole float4s; else 1): at one
// column a thread, the tile's index arithmetic outweighed its four loads (Nsight Compute on an
// H100, 2026-12-06: SM 75 % busy, DRAM 41 %). Block blk is column slice blk % chunks of job
// blk / chunks: k's tiles, then v's.
WL_DEVICE void vsa_sums_means(float* km, float* vm, const float* ks, const float* vs, int gt, int gh, int gw, int nk,
                              int row, int chunks, int per, int d, int blk) {
    int job = blk / chunks;
    const int c = ((blk % chunks) * blockDim.x + threadIdx.x) * per;
    if (c >= row) return;
    const bool is_k = job < nk;
    if (!is_k) job -= nk;
    const float* src = is_k ? ks : vs;
    // k's means in the coarse kernel's layout (vsa_kt; a float4 is one head's when per is 4, as d
    // is then a multiple of 4), v's as rows.
    float* dst = is_k ? km + vsa_kt(job, c / d, c % d, nk, d) : vm + (wl_u64)job * row + c;
    const vsa_tile b = vsa_tile_of(job, gt, gh, gw);
    const int nh = (gh + 3) / 4, nw = (gw + 3) / 4;
    const float n = (float)(b.lt * b.lh * b.lw);
    const float* slab = src + ((wl_u64)(b.t0 * nh + b.h0 / 4) * nw + b.w0 / 4) * row + c;
    const wl_u64 step = (wl_u64)nh * nw * row;  // one frame's slabs
    if (per == 4) {
        // The (at most four) frames' loads all issued before the first add, the adds in frame
        // order as before: with a load and its add a frame at a time, the kernel waited on each
        // load in turn (Nsight Compute, H100, 2026-12-06: 26 µs, its samples on those adds).
        float4 v[4];
        for (int f = 0; f < 4; ++f)
            if (f < b.lt) v[f] = *(const float4*)(slab + f * step);
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int f = 0; f < 4; ++f)
            if (f < b.lt) acc.x += v[f].x, acc.y += v[f].y, acc.z += v[f].z, acc.w += v[f].w;
        *(float4*)dst = make_float4(acc.x / n, acc.y / n, acc.z / n, acc.w / n);
        return;
    }
    float acc = 0.0f;
    for (int f = 0; f < b.lt; ++f) acc += slab[f * step];
    *dst = acc / n;
}

// The means a call over a cache with key sums needs, in one launch: blocks [0, nq · q_chunks)
// the query tiles' (as vsa_tile_means' q jobs), the rest the key (and value) tile means from the
// frame sums (vsa_sums_means, `s_chunks` blocks a tile). The two are independent, and as two
// launches each left the GPU waiting on its loads (22 and 26 µs under Nsight Compute on an H100,
// 2026-12-06). Making a chunk's frame sums in this pass too, for the tiles that hold its frames,
// was 2.5–4 % slower a call than their own launch before it (H100, 2026-12-07: 86 registers and a
// tail of those tiles' blocks; branch vsa-fresh-sums).
template <typename T>
WL_DEVICE void vsa_means_cached(float* qm, const T* q, const int* q_order, const int* q_offsets, const int* q_sizes,
                                int nq, int q_chunks, float* km, float* vm, const float* ks, const float* vs, int gt,
                                int gh, int gw, int nk, int row, int s_chunks, int per, int d) {
    const int qb = nq * q_chunks;
    if ((int)blockIdx.x < qb) {
        vsa_mean_job(qm, q, q_order, q_offsets, q_sizes, blockIdx.x / q_chunks, blockIdx.x % q_chunks, (wl_u64)row);
        return;
    }
    vsa_sums_means(km, vm, ks, vs, gt, gh, gw, nk, row, s_chunks, per, d, blockIdx.x - qb);
}

// vsa_means_cached where the queries' slab sums are given too (ops::rms_norm_rope_sums leaves
// them as it writes q): blocks [0, nq · s_chunks) the query tiles' means from `qs` on the query
// grid (qt, qh, qw), as rows, the rest the key (and value) means as there, so no block reads a
// token.
WL_KERNEL void vsa_means_all_sums(float* qm, const float* qs, int qt, int qh, int qw, int nq, float* km, float* vm,
                                  const float* ks, const float* vs, int gt, int gh, int gw, int nk, int row,
                                  int s_chunks, int per, int d) {
    const int qb = nq * s_chunks;
    if ((int)blockIdx.x < qb) {
        // As a value job (rows, no key layout): nk = 0 makes every job one, and the key
        // pointers unread (real ones all the same: clang 22 crashed inlining null ones).
        vsa_sums_means(qm, qm, qs, qs, qt, qh, qw, 0, row, s_chunks, per, d, blockIdx.x);
        return;
    }
    vsa_sums_means(km, vm, ks, vs, gt, gh, gw, nk, row, s_chunks, per, d, blockIdx.x - qb);
}

// Scores as unsigned keys whose order is Rust's `f32::total_cmp` (the CPU's sort): flip every bit
// of a negative, the sign bit of a positive.
WL_DEVICE unsigned int vsa_key(float s) {
    const unsigned int u = __float_as_uint(s);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
WL_DEVICE float vsa_score(unsigned int key) {
    return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

WL_DEVICE int vsa_warp_sum(int v) {
#if defined(WL_CUDA)
    // One instruction (sm_80+) where the shuffle ladder is five dependent round trips: the top-k
    // search below takes up to 32 of these in a row.
    return (int)__reduce_add_sync(0xffffffffu, (unsigned int)v);
#else
    const int lane = threadIdx.x % WL_WARP_SIZE;
    for (int o = WL_WARP_SIZE / 2; o > 0; o >>= 1) v += wl_shfl(v, lane ^ o);
    return v;
#endif
}

// The index of x's highest set bit (x ≠ 0).
WL_DEVICE int vsa_top_bit(unsigned int x) {
#if defined(WL_CUDA)
    return 31 - __clz((int)x);
#else
    return 31 - __builtin_clz(x);
#endif
}
// Warp-wide min and max of unsigned keys.
WL_DEVICE unsigned int vsa_warp_min(unsigned int v) {
#if defined(WL_CUDA)
    return __reduce_min_sync(0xffffffffu, v);
#else
    const int lane = threadIdx.x % WL_WARP_SIZE;
    for (int o = WL_WARP_SIZE / 2; o > 0; o >>= 1) v = min(v, (unsigned int)wl_shfl((int)v, lane ^ o));
    return v;
#endif
}
WL_DEVICE unsigned int vsa_warp_max(unsigned int v) {
#if defined(WL_CUDA)
    return __reduce_max_sync(0xffffffffu, v);
#else
    const int lane = threadIdx.x % WL_WARP_SIZE;
    for (int o = WL_WARP_SIZE / 2; o > 0; o >>= 1) v = max(v, (unsigned int)wl_shfl((int)v, lane ^ o));
    return v;
#endif
}

// a0[r] += q[r, e0 + e] · k0[e] and a1[r] += q[r, e0 + e] · k1[e] for the four elements of two key
// tiles held in registers, in element order, one fused multiply-add each (one rounding; CUDA's
// and HIP's fmaf, Rust's mul_add): the CPU's `coarse_dot`, whose sum starts at -0.0. Each query
// float4 read from shared memory serves both tiles: half the shared-memory loads of one tile at
// a time.
template <int QG>
WL_DEVICE void vsa_dot_pair(float* a0, float* a1, const float (*qs)[WL_VSA_MAX_D], float4 k0, float4 k1, int e0) {
    const float kk0[4] = {k0.x, k0.y, k0.z, k0.w};
    const float kk1[4] = {k1.x, k1.y, k1.z, k1.w};
    for (int r = 0; r < QG; ++r) {
        const float4 qv = *(const float4*)(&qs[r][e0]);
        const float qq[4] = {qv.x, qv.y, qv.z, qv.w};
        for (int u = 0; u < 4; ++u) {
            a0[r] = fmaf(qq[u], kk0[u], a0[r]);
            a1[r] = fmaf(qq[u], kk1[u], a1[r]);
        }
    }
}

// The `top_k` largest of a row's nk keys, ties to the lower index, written in increasing index
// order to dst by one warp: a bitwise search for the largest t with at least top_k keys ≥ t
// (when exactly top_k keys reach a candidate, those are the selection: t just below it), then
// one pass in index order that writes the keys above t and the first ties. A lane holds its
// keys j ≡ lane (mod warp) in KR registers (KR = 0: read from shared memory at each bit; LingBot's
// 520 key tiles take KR = 17): 32 loads a key fewer, and the counts of a bit no longer wait on
// shared memory.
template <int KR>
WL_DEVICE void vsa_select(int* dst, const unsigned int* kr, int nk, int top_k, int lane) {
    const int n = KR ? KR : (nk + WL_WARP_SIZE - 1) / WL_WARP_SIZE;
    unsigned int kv[KR ? KR : 1];
    // Past nk a key reads 0, which reaches no candidate (each is ≥ 1) and is above no threshold.
    auto key = [&](int i) -> unsigned int {
        if constexpr (KR > 0) {
            return kv[i];
        } else {
            const int j = lane + i * WL_WARP_SIZE;
            return j < nk ? kr[j] : 0u;
        }
    };
    if constexpr (KR > 0)
        for (int i = 0; i < KR; ++i) kv[i] = lane + i * WL_WARP_SIZE < nk ? kr[lane + i * WL_WARP_SIZE] : 0u;
    // The search's answer lies in [lo, hi]: hi is the largest key; lo, the least over lanes of
    // each lane's second largest, has at least 2 · warp keys at or above it, so where that is
    // top_k or more the answer is at least lo. The bits above the highest one where lo and hi
    // differ are then the answer's, and the search starts below them (with LingBot's scores
    // the sign and exponent bits, at least 9 of the 32 rounds).
    unsigned int t = 0;
    int top = 31;
    if (top_k <= 2 * WL_WARP_SIZE) {
        unsigned int m1 = 0, m2 = 0;
        for (int i = 0; i < n; ++i) {
            const unsigned int k = key(i);
            m2 = max(m2, min(m1, k));
            m1 = max(m1, k);
        }
        const unsigned int lo = vsa_warp_min(m2), hi = vsa_warp_max(m1);
        if (lo != hi) {
            top = vsa_top_bit(lo ^ hi);
            t = lo & ~((2u << top) - 1);
        } else {
            // Every lane's second largest is the largest key: the answer is that key.
            t = lo;
            top = -1;
        }
    }
    for (int bit = top; bit >= 0; --bit) {
        const unsigned int cand = t | (1u << bit);
        // Two sums, so the compares of a bit are not one chain of adds.
        int c[2] = {0, 0};
        for (int i = 0; i < n; ++i) c[i & 1] += key(i) >= cand;
        const int cnt = vsa_warp_sum(c[0] + c[1]);
        if (cnt == top_k) {
            t = cand - 1;
            break;
        }
        if (cnt > top_k) t = cand;
    }
    int above = 0;
    for (int i = 0; i < n; ++i) above += key(i) > t;
    // Keys above t are all kept; of those equal to t, the `ties` lowest indices.
    const int ties = top_k - vsa_warp_sum(above);
    // Each key's place among the written ones from two ballots (the lanes below it that write
    // keys above t, that hold ties), not a warp scan of five dependent shuffles a step.
    const wl_lanes below = wl_lanes_below(lane);
    int n_above = 0, n_eq = 0;
    for (int i = 0; i < n && n_above + min(n_eq, ties) < top_k; ++i) {
        const int j = lane + i * WL_WARP_SIZE;
        const unsigned int kj = key(i);
        const bool up = kj > t, eq = j < nk && kj == t;
        const wl_lanes ups = wl_ballot(up), eqs = wl_ballot(eq);
        const int eq_before = n_eq + wl_popc_lanes(eqs & below);
        if (up || (eq && eq_before < ties)) dst[n_above + wl_popc_lanes(ups & below) + min(eq_before, ties)] = j;
        n_above += wl_popc_lanes(ups);
        n_eq += wl_popc_lanes(eqs);
    }
}

// One block per (group of QG query tiles, head h), which shares each key tile's means read from
// memory across its QG query tiles:
// 1. the coarse scores of its query tiles against every key tile, kept in shared memory as
//    total-order keys (a thread per two key tiles, all QG rows; the tiles' means, kc in
//    vsa_kt's layout, go from memory straight into registers four elements at a time, a warp's
//    loads 512 contiguous bytes);
// 2. per query tile (a warp each), the `top_k` best key tiles to `kept[i, h, :]` (vsa_select);
// 3. the same warp replaces the row's scores by their softmax weights;
// 4. `coarse[i, h, :]` = the weights applied to the key-tile means, the key tiles split among
//    groups of threads (four elements of d each) and the groups' sums added in shared memory.
// Dynamic shared memory: QG rows of ⌈nk⌉₄ keys; phase 4 reuses it for the groups' sums
// (vsa_attention sizes it). Phase 1 has no barrier: until 2026-12-06 it staged each slice of
// rows of [nk, heads, d] through shared memory between two barriers (~100 µs a 40-head LingBot
// call on an H100, ~90 µs with the barriers gone but each lane's loads on a line of their own).
template <int QG>
WL_DEVICE void vsa_coarse(float* coarse, int* kept, const float* qc, const float* kc, const float* vc, int nq,
                          int nk, int heads, int d, int top_k, float scale, int with_out) {
    extern __shared__ __align__(16) unsigned int vsa_smem[];
    // float4 elements for the 16-byte alignment of the rows' vector reads.
    __shared__ float4 qs4[QG][WL_VSA_MAX_D / 4];
    float (*qs)[WL_VSA_MAX_D] = (float (*)[WL_VSA_MAX_D])qs4;
    const int tid = threadIdx.x, nt = blockDim.x;
    const int i0 = blockIdx.x * QG, h = blockIdx.y;
    const int rows = min(QG, nq - i0);
    const int nks = (nk + 3) & ~3, dp = (d + 3) & ~3;
    unsigned int* keys = vsa_smem;
    const bool vec = (d & 3) == 0;

    for (int r = 0; r < QG; ++r)
        for (int e = tid; e < dp; e += nt)
            qs[r][e] = r < rows && e < d ? qc[((wl_u64)(i0 + r) * heads + h) * d + e] : 0.0f;
    __syncthreads();
    if (vec) {
        // Key tiles j0 and j0 + nt (where it is one) in one pass, each query float4 read from
        // shared memory once for both. A tile's means (vsa_kt: whole float4s, 16-byte aligned)
        // go from memory straight into registers four elements at a time, the next four nk
        // float4s on; the 32 warps an SM holds hide the loads' latency (two float4s a tile at a
        // time spilled at the 64 registers four blocks an SM leave a thread; ptxas, sm_90a).
        // With top-k's search from its bounds' shared bits, a LingBot call 0.3-0.7 % faster
        // than one tile a thread (H100, 2026-12-07, in turn in one call; BENCHMARKS.md).
        for (int j0 = tid; j0 < nk; j0 += 2 * nt) {
            const int j1 = j0 + nt;
            const bool two = j1 < nk;
            const float4* c0 = (const float4*)(kc + vsa_kt(j0, h, 0, nk, d));
            const float4* c1 = (const float4*)(kc + vsa_kt(two ? j1 : j0, h, 0, nk, d));
            float a0[QG], a1[QG];
            for (int r = 0; r < QG; ++r) a0[r] = -0.0f, a1[r] = -0.0f;
            for (int e0 = 0; e0 < d; e0 += 4)
                vsa_dot_pair<QG>(a0, a1, qs, c0[(wl_u64)(e0 / 4) * nk], c1[(wl_u64)(e0 / 4) * nk], e0);
            for (int r = 0; r < QG; ++r) {
                keys[r * nks + j0] = vsa_key(__fmul_rn(a0[r], scale));
                if (two) keys[r * nks + j1] = vsa_key(__fmul_rn(a1[r], scale));
            }
        }
    } else {
        for (int j = tid; j < nk; j += nt) {
            float acc[QG];
            for (int r = 0; r < QG; ++r) acc[r] = -0.0f;
            for (int e = 0; e < d; ++e) {
                const float k = kc[vsa_kt(j, h, e, nk, d)];
                for (int r = 0; r < QG; ++r) acc[r] = fmaf(qs[r][e], k, acc[r]);
            }
            for (int r = 0; r < QG; ++r) keys[r * nks + j] = vsa_key(__fmul_rn(acc[r], scale));
        }
    }
    __syncthreads();

    const int warp = tid / WL_WARP_SIZE, lane = tid % WL_WARP_SIZE, warps = nt / WL_WARP_SIZE;
    for (int r = warp; r < rows; r += warps) {
        unsigned int* kr = keys + r * nks;
        int* dst = kept + ((wl_u64)(i0 + r) * heads + h) * top_k;
        if (nk <= 8 * WL_WARP_SIZE)
            vsa_select<8>(dst, kr, nk, top_k, lane);
        else if (nk <= 17 * WL_WARP_SIZE)
            vsa_select<17>(dst, kr, nk, top_k, lane);
        else
            vsa_select<0>(dst, kr, nk, top_k, lane);
        if (!with_out) continue;
        float mx = -WL_INF;
        for (int j = lane; j < nk; j += WL_WARP_SIZE) mx = fmaxf(mx, vsa_score(kr[j]));
        for (int o = WL_WARP_SIZE / 2; o > 0; o >>= 1) mx = fmaxf(mx, wl_shfl_xor(mx, o));
        float sum = 0.0f;
        for (int j = lane; j < nk; j += WL_WARP_SIZE) sum += expf(vsa_score(kr[j]) - mx);
        for (int o = WL_WARP_SIZE / 2; o > 0; o >>= 1) sum += wl_shfl_xor(sum, o);
        // Each lane rewrites only the entries it read above, so no other lane's reads race it.
        for (int j = lane; j < nks; j += WL_WARP_SIZE)
            kr[j] = __float_as_uint(j < nk ? expf(vsa_score(kr[j]) - mx) / sum : 0.0f);
    }
    // Select-only (vsa.rs's Coarse::SelectOnly): no coarse output, and vc was never computed.
    if (!with_out) return;
    __syncthreads();

    // A thread sums four elements of d of every row over the key tiles j ≡ 4g (mod 4·groups), one
    // tile's means at a time (few registers: 64 a thread in all); the weights of tiles past nk
    // are zeros, so the loads need no condition and may be issued ahead. The groups' partial
    // sums then meet in shared memory.
    const int nc = (d + 3) / 4, groups = nt / nc;
    const int g = tid / nc, c = tid % nc;
    float acc[QG][4];
    for (int r = 0; r < QG; ++r)
        for (int w = 0; w < 4; ++w) acc[r][w] = 0.0f;
    if (g < groups) {
        const float* src = vc + (wl_u64)h * d + 4 * c;
        const wl_u64 step = (wl_u64)heads * d;
        for (int j = 4 * g; j < nk; j += 4 * groups) {
            for (int u = 0; u < 4; ++u) {
                const float* vj = src + (wl_u64)min(j + u, nk - 1) * step;
                float vv[4];
                if (vec) {
                    const float4 f = *(const float4*)vj;
                    vv[0] = f.x;
                    vv[1] = f.y;
                    vv[2] = f.z;
                    vv[3] = f.w;
                } else {
                    for (int w = 0; w < 4; ++w) vv[w] = 4 * c + w < d ? vj[w] : 0.0f;
                }
                for (int r = 0; r < QG; ++r) {
                    const float p = __uint_as_float(keys[r * nks + j + u]);
                    for (int w = 0; w < 4; ++w) acc[r][w] += p * vv[w];
                }
            }
        }
    }
    __syncthreads();
    float* part = (float*)vsa_smem;
    if (g < groups) {
        for (int r = 0; r < QG; ++r) {
            float4 f;
            f.x = acc[r][0];
            f.y = acc[r][1];
            f.z = acc[r][2];
            f.w = acc[r][3];
            *(float4*)(part + ((g * QG + r) * nc + c) * 4) = f;
        }
    }
    __syncthreads();
    for (int x = tid; x < rows * d; x += nt) {
        const int r = x / d, e = x % d;
        float s = 0.0f;
        for (int gg = 0; gg < groups; ++gg) s += part[(gg * QG + r) * nc * 4 + e];
        coarse[((wl_u64)(i0 + r) * heads + h) * d + e] = s;
    }
}

// Four coarse blocks an SM on CUDA (64 registers a thread; 72 allowed three): LingBot's 520
// blocks at 40 heads then run in one wave instead of 1.3.
#if defined(WL_CUDA)
#define WL_VSA_COARSE_BOUNDS __launch_bounds__(WL_VSA_COARSE_THREADS, 4)
#else
#define WL_VSA_COARSE_BOUNDS __launch_bounds__(WL_VSA_COARSE_THREADS)
#endif
#define WL_VSA_COARSE(qg)                                                                                      \
    WL_KERNEL void WL_VSA_COARSE_BOUNDS vsa_coarse_##qg(float* coarse, int* kept, const float* qc, const float* kc, const float* vc, \
                                   int nq, int nk, int heads, int d, int top_k, float scale, int with_out) {  \
        vsa_coarse<qg>(coarse, kept, qc, kc, vc, nq, nk, heads, d, top_k, scale, with_out);                   \
    }
WL_VSA_COARSE(8)
WL_VSA_COARSE(4)
WL_VSA_COARSE(2)
WL_VSA_COARSE(1)

// One warp per (tiled query position p, head): online softmax over the tokens of the kept key
// tiles, lanes scoring a key each; out = fine + its coarse term (wl_vsa_coarse: by `mix`).
template <typename T>
WL_DEVICE void vsa_fine(T* out, const T* q, const T* k, const T* v, const T* gate, int mix, const float* coarse,
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
            wl_st(out, at, acc[e] * inv + wl_vsa_coarse(mix, gate, at, c + dim));
        }
    }
}

#define WL_VSA(T, tn)                                                                                         \
    WL_KERNEL void vsa_tile_means_##tn(float* qm, float* km, float* vm, const T* q, const T* k, const T* v,     \
                                       const int* q_order, const int* q_offsets, const int* q_sizes,           \
                                       const int* k_order, const int* k_offsets, const int* k_sizes, int nq,   \
                                       int nk, int row, int chunks, int d) {                                   \
        vsa_tile_means(qm, km, vm, q, k, v, q_order, q_offsets, q_sizes, k_order, k_offsets, k_sizes, nq, nk, row, \
                       chunks, d);                                                                             \
    }                                                                                                         \
    WL_KERNEL void vsa_means_from_sums_##tn(float* qm, const T* q, const int* q_order, const int* q_offsets,      \
                                            const int* q_sizes, int nq, int q_chunks, float* km, float* vm,       \
                                            const float* ks, const float* vs, int gt, int gh, int gw, int nk,     \
                                            int row, int s_chunks, int per, int d) {                              \
        vsa_means_cached(qm, q, q_order, q_offsets, q_sizes, nq, q_chunks, km, vm, ks, vs, gt, gh, gw, nk, row,  \
                         s_chunks, per, d);                                                                    \
    }                                                                                                         \
    WL_KERNEL void vsa_frame_sums_##tn(float* out, const T* x, wl_u64 first, int gh, int gw, wl_u64 row,        \
                                       int chunks) {                                                           \
        vsa_frame_sums(out, x, first, gh, gw, row, chunks);                                                   \
    }                                                                                                         \
    WL_KERNEL void vsa_fine_##tn(T* out, const T* q, const T* k, const T* v, const T* gate, int mix,            \
                                 const float* coarse,                                                         \
                                 const int* kept, const int* q_order, const int* q_tile, const int* k_order,  \
                                 const int* k_offsets, const int* k_sizes, int lq, int heads, int d, int top_k, \
                                 float scale) {                                                               \
        vsa_fine(out, q, k, v, gate, mix, coarse, kept, q_order, q_tile, k_order, k_offsets, k_sizes, lq, heads, d,  \
                 top_k, scale);                                                                               \
    }

WL_VSA(float, f32)
WL_VSA(wl_bf16, bf16)
