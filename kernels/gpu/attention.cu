// Attention over a KV cache, correctness first: one warp per (query, head), keys in groups of a
// warp (each lane scores one key), online softmax in f32, each lane accumulating the output dims
// lane, lane + W, … The tiled tensor-core kernel replaces this for speed; this one is the GPU
// reference it will be checked against.

#define WL_ATT_MAX_D 256
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
