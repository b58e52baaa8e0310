// The video VAE's ops on channels-first [C, T, H, W] data: the im2col half of a convolution (the
// GEMM half is cuBLASLt), the per-channel bias, norm and affine, nearest upsampling, clamps, the
// row softmax of its per-frame attention, and (tensor cores) the implicit-GEMM convolution.
// Per-channel parameters arrive as f32 (the host casts them: they are a few hundred values).

// Column matrix of one tile: row (c, a, b, e) holds that tap's input for output rows r0 .. r0+nr
// of output frames ot .. ot+nf (frame by frame, positions contiguous); taps in the zero padding
// read 0. Row-major [cin·kt·kh·kw, nf·nr·wo]. One grid row per column row (blockIdx.y), so the
// tap is decoded once per thread and neighbouring threads read neighbouring pixels.
template <typename T>
WL_DEVICE void im2col(T* col, const T* x, int cin, int ti, int hi, int wi, int kt, int kh, int kw, int st, int sh,
                      int sw, int pt, int ph, int pw, int ot, int nf, int r0, int nr, int wo) {
    const int row = blockIdx.y;
    const int e = row % kw, b = (row / kw) % kh, a = (row / (kw * kh)) % kt, c = row / (kw * kh * kt);
    const int per_frame = nr * wo, n = nf * per_frame;
    T* dst = col + (wl_u64)row * n;
    for (int pos = blockIdx.x * blockDim.x + threadIdx.x; pos < n; pos += gridDim.x * blockDim.x) {
        const int f = pos / per_frame, rem = pos - f * per_frame;
        const int oy = rem / wo, ox = rem - oy * wo;
        const int it = (ot + f) * st + a - pt;
        const int iy = (r0 + oy) * sh + b - ph, ix = ox * sw + e - pw;
        float v = 0.0f;
        if (it >= 0 && it < ti && iy >= 0 && iy < hi && ix >= 0 && ix < wi)
            v = wl_ld(x, (((wl_u64)c * ti + it) * hi + iy) * wi + ix);
        wl_st(dst, pos, v);
    }
}

// In place: y[c, i] += bias[c] for `per_channel` values per channel.
template <typename T>
WL_DEVICE void add_channel_bias(T* y, const float* bias, wl_u64 per_channel, wl_u64 n) {
    WL_GRID_STRIDE(i, n) { wl_st(y, i, wl_ld(y, i) + bias[i / per_channel]); }
}

// After a library convolution (cuDNN): + bias[channel] (f32, or null), + res (the output's
// layout, or null), then ReLU when act (NaN kept), in f32 and rounded once, in place. Element i
// is of channel (i / per_channel) % channels: channels-first output has per_channel positions a
// channel, channels-last (per_channel 1) the channels innermost.
template <typename T>
WL_DEVICE void conv_epilogue(T* y, const float* bias, const T* res, wl_u64 per_channel, wl_u64 channels, wl_u64 n,
                             int act) {
    WL_GRID_STRIDE(i, n) {
        float v = wl_ld(y, i);
        if (bias) v += bias[(per_channel == 1 ? i : i / per_channel) % channels];
        if (res) v += wl_ld(res, i);
        if (act && v < 0.0f) v = 0.0f;
        wl_st(y, i, v);
    }
}

// At each of the n positions: the channel vector over its L2 norm (floored at eps), times sqrt(c)
// and gamma[c]; in f64 like the CPU reference, so both round the same products once. With
// `silu` the VAE's SiLU after the norm is applied before the one rounding to T (a pass fewer).
template <typename T>
WL_DEVICE void channel_rms_norm(T* out, const T* x, const float* gamma, int c, wl_u64 n, float eps, int silu) {
    WL_GRID_STRIDE(i, n) {
        double ss = 0.0;
        for (int k = 0; k < c; ++k) {
            const double v = wl_ld(x, (wl_u64)k * n + i);
            ss += v * v;
        }
        const double s = sqrt((double)c) / fmax(sqrt(ss), (double)eps);
        for (int k = 0; k < c; ++k) {
            const wl_u64 at = (wl_u64)k * n + i;
            const float y = (float)((double)wl_ld(x, at) * s) * gamma[k];
            wl_st(out, at, silu ? y / (1.0f + expf(-y)) : y);
        }
    }
}

template <typename T>
WL_DEVICE void channel_affine(T* out, const T* x, const float* mul, const float* add, wl_u64 per_channel, wl_u64 n) {
    WL_GRID_STRIDE(i, n) {
        const wl_u64 c = i / per_channel;
        // Two roundings, as on the CPU (no fused multiply-add).
        wl_st(out, i, __fadd_rn(__fmul_rn(wl_ld(x, i), mul[c]), add[c]));
    }
}

// `outer` planes of h × w pixels of q units each (a unit: one element, or 16 bytes of a
// channels-last pixel's channels), each pixel repeated fh × fw times. 32-bit index math: the
// host checks that the output's units fit, and the divisions are most of the cost.
template <typename U>
WL_DEVICE void upsample_nearest(U* out, const U* x, unsigned h, unsigned w, unsigned q, unsigned fh, unsigned fw,
                                unsigned total) {
    const unsigned ow = w * fw, oh = h * fh;
    for (unsigned i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        const unsigned c = i % q, pix = i / q;
        const unsigned xx = pix % ow, rest = pix / ow;
        const unsigned y = rest % oh, p = rest / oh;
        out[i] = x[((p * h + y / fh) * w + xx / fw) * q + c];
    }
}

WL_KERNEL void upsample_nearest_u16(unsigned short* out, const unsigned short* x, unsigned h, unsigned w, unsigned q,
                                    unsigned fh, unsigned fw, unsigned total) {
    upsample_nearest(out, x, h, w, q, fh, fw, total);
}
WL_KERNEL void upsample_nearest_u32(unsigned* out, const unsigned* x, unsigned h, unsigned w, unsigned q, unsigned fh,
                                    unsigned fw, unsigned total) {
    upsample_nearest(out, x, h, w, q, fh, fw, total);
}
WL_KERNEL void upsample_nearest_u128(uint4* out, const uint4* x, unsigned h, unsigned w, unsigned q, unsigned fh,
                                     unsigned fw, unsigned total) {
    upsample_nearest(out, x, h, w, q, fh, fw, total);
}

// The channels-last epilogue in bf16 with 8 channels (16 bytes) a thread, channels a multiple
// of 8: one index division per 8 values instead of two per value, and whole-vector accesses.
// The same arithmetic, in the same order, as conv_epilogue.
WL_KERNEL void conv_epilogue_cl8_bf16(uint4* y, const float* bias, const uint4* res, unsigned channels, wl_u64 vecs,
                                      int act) {
    const unsigned cv = channels / 8;
    WL_GRID_STRIDE(v, vecs) {
        const unsigned c0 = 8u * (unsigned)(v % cv);
        uint4 yw = y[v];
        const uint4 rw = res ? res[v] : make_uint4(0, 0, 0, 0);
        unsigned* yp = (unsigned*)&yw;
        const unsigned* rp = (const unsigned*)&rw;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float lo = __uint_as_float(yp[k] << 16), hi = __uint_as_float(yp[k] & 0xffff0000u);
            if (bias) {
                lo += bias[c0 + 2 * k];
                hi += bias[c0 + 2 * k + 1];
            }
            if (res) {
                lo += __uint_as_float(rp[k] << 16);
                hi += __uint_as_float(rp[k] & 0xffff0000u);
            }
            if (act && lo < 0.0f) lo = 0.0f;
            if (act && hi < 0.0f) hi = 0.0f;
            yp[k] = wl_pack_bf16(lo, hi);
        }
        y[v] = yw;
    }
}

// NaN passes through both clamps, as on the CPU.
template <typename T>
WL_DEVICE void clamp(T* out, const T* x, wl_u64 n, float lo, float hi) {
    WL_GRID_STRIDE(i, n) {
        const float v = wl_ld(x, i);
        wl_st(out, i, v != v ? v : fminf(fmaxf(v, lo), hi));
    }
}

template <typename T>
WL_DEVICE void soft_clamp(T* out, const T* x, wl_u64 n, float limit) {
    WL_GRID_STRIDE(i, n) { wl_st(out, i, tanhf(wl_ld(x, i) / limit) * limit); }
}

// Softmax of each row of x · scale (rows of `cols` values), f32 math: one block per row.
template <typename T>
WL_DEVICE void softmax_rows(T* out, const T* x, wl_u64 cols, float scale) {
    __shared__ float scratch[32];
    const T* xr = x + (wl_u64)blockIdx.x * cols;
    T* yr = out + (wl_u64)blockIdx.x * cols;
    float m = -WL_INF;
    for (wl_u64 i = threadIdx.x; i < cols; i += blockDim.x) m = fmaxf(m, wl_ld(xr, i) * scale);
    m = wl_block_max(m, scratch);
    float sum = 0.0f;
    for (wl_u64 i = threadIdx.x; i < cols; i += blockDim.x) sum += expf(wl_ld(xr, i) * scale - m);
    const float inv = 1.0f / wl_block_sum(sum, scratch);
    for (wl_u64 i = threadIdx.x; i < cols; i += blockDim.x) wl_st(yr, i, expf(wl_ld(xr, i) * scale - m) * inv);
}

#define WL_CONV(T, tn)                                                                                      \
    WL_KERNEL void im2col_##tn(T* col, const T* x, int cin, int ti, int hi, int wi, int kt, int kh, int kw,   \
                               int st, int sh, int sw, int pt, int ph, int pw, int ot, int nf, int r0, int nr, \
                               int wo) {                                                                    \
        im2col(col, x, cin, ti, hi, wi, kt, kh, kw, st, sh, sw, pt, ph, pw, ot, nf, r0, nr, wo);             \
    }                                                                                                       \
    WL_KERNEL void add_channel_bias_##tn(T* y, const float* bias, wl_u64 per_channel, wl_u64 n) {           \
        add_channel_bias(y, bias, per_channel, n);                                                          \
    }                                                                                                       \
    WL_KERNEL void conv_epilogue_##tn(T* y, const float* bias, const T* res, wl_u64 per_channel,              \
                                      wl_u64 channels, wl_u64 n, int act) {                                 \
        conv_epilogue(y, bias, res, per_channel, channels, n, act);                                         \
    }                                                                                                       \
    WL_KERNEL void channel_rms_norm_##tn(T* out, const T* x, const float* gamma, int c, wl_u64 n, float eps,  \
                                         int silu) {                                                        \
        channel_rms_norm(out, x, gamma, c, n, eps, silu);                                                   \
    }                                                                                                       \
    WL_KERNEL void channel_affine_##tn(T* out, const T* x, const float* mul, const float* add,              \
                                       wl_u64 per_channel, wl_u64 n) {                                      \
        channel_affine(out, x, mul, add, per_channel, n);                                                   \
    }                                                                                                       \
    WL_KERNEL void clamp_##tn(T* out, const T* x, wl_u64 n, float lo, float hi) { clamp(out, x, n, lo, hi); } \
    WL_KERNEL void soft_clamp_##tn(T* out, const T* x, wl_u64 n, float limit) { soft_clamp(out, x, n, limit); } \
    WL_KERNEL void softmax_rows_##tn(T* out, const T* x, wl_u64 cols, float scale) {                          \
        softmax_rows(out, x, cols, scale);                                                                  \
    }

WL_CONV(float, f32)
WL_CONV(wl_bf16, bf16)

#if defined(WL_HAS_MMA_BF16)
// Implicit-GEMM convolution on tensor cores, bf16 operands, f32 accumulation: out[o, p] =
// Σ_k w[o, k] · x[k, p] with k = (temporal tap, input channel, spatial tap), never materialised.
// A block computes BM output channels × one tile of TH × 16 output pixels of one output frame.
// Per temporal tap and chunk of 32 input channels it stages the input tile with its halo in
// shared memory as [pixel][channel] (channels contiguous, so ldmatrix hands out B fragments for
// any pixel row) and the weights of every spatial tap as [tap][o][channel]; then each spatial
// tap is two k16 steps whose B rows are the tile's pixels shifted by that tap. Input channels
// past `cin` and pixels in the zero padding are staged as zeros; the host packs the weights
// (`conv_pack_weights_bf16`) with channels and outputs padded to whole chunks and blocks.
#define CV_CK 32
// Row pitch in bf16 (80 bytes): the 8 rows of one ldmatrix fall in distinct bank groups.
#define CV_PITCH (CV_CK + 8)
#define CV_TW 16

// wp[t][o][c] (t over kt·kh·kw taps, o < coutp, c < cinp) from w[o][c][t], zeros outside.
WL_KERNEL void conv_pack_weights_bf16(wl_bf16* wp, const wl_bf16* w, int cout, int cin, int taps, int coutp,
                                      int cinp) {
    WL_GRID_STRIDE(i, (wl_u64)taps * coutp * cinp) {
        const int c = (int)(i % cinp), o = (int)((i / cinp) % coutp), t = (int)(i / ((wl_u64)cinp * coutp));
        wp[i] = (o < cout && c < cin) ? w[((wl_u64)o * cin + c) * taps + t] : (wl_bf16)0;
    }
}

// Warps: WM along the output channels (MT m16 tiles each), 8 / WM along the pixels (two output
// rows × 16 columns each: four n8 groups). The epilogue adds the bias, then `res` (a residual
// of the output's layout, or null), then applies ReLU when `act` is 1 (NaN kept), in f32, and
// rounds once.
//
// Latency is hidden by occupancy (3 blocks of 8 warps per SM at ≤ 80 registers): on the H200 that
// beat 2 blocks a SM by 7-9 %, and a software-pipelined variant (the next stage's weights by
// cp.async into a second buffer and its input in registers during this stage's products, 2
// blocks a SM for the shared memory) was 2-6 % slower than the plain loop (bench codecs, bf16).

struct CvGeom {
    int cin, cinp, ti, hi, wi, kt, kh, kw, st, sh, sw, pt, ph, pw, cout, coutp, to, ho, wo;
};

// Weights of temporal tap a, channels c0 .. c0+32, outputs o0 .. o0+BM, every spatial tap.
template <int BM>
WL_DEVICE void cv_stage_weights(wl_bf16* ws, const wl_bf16* wp, const CvGeom& g, int a, int c0, int o0) {
    const int taps2 = g.kh * g.kw;
    const wl_bf16* wsrc = wp + ((wl_u64)a * taps2 * g.coutp + o0) * g.cinp + c0;
    for (int i = threadIdx.x; i < taps2 * BM * 4; i += blockDim.x) {
        const int q = i % 4, r = (i / 4) % BM, s = i / (4 * BM);
        wl_cp_async16(ws + (s * BM + r) * CV_PITCH + q * 8, wsrc + ((wl_u64)s * g.coutp + r) * g.cinp + q * 8, true);
    }
}

// One input task: 8 channels (c0 + 8q ..) of pixel p of the halo tile, packed as 4 words.
WL_DEVICE uint4 cv_load_input(const wl_bf16* x, const CvGeom& g, int it, int c0, int iy0, int ix0, int iw_ext, int npix,
                              int i) {
    const int p = i % npix, q = i / npix;
    const int py = p / iw_ext, px = p - py * iw_ext;
    const int iy = iy0 + py, ix = ix0 + px;
    unsigned int v[4] = {0u, 0u, 0u, 0u};
    if (iy >= 0 && iy < g.hi && ix >= 0 && ix < g.wi) {
        const wl_u64 chan = (wl_u64)g.ti * g.hi * g.wi;
        const wl_bf16* src = x + (wl_u64)(c0 + q * 8) * chan + ((wl_u64)it * g.hi + iy) * g.wi + ix;
        const int left = g.cin - (c0 + q * 8);
#pragma unroll
        for (int k = 0; k < 8; k += 2) {
            const unsigned int lo = k < left ? src[(wl_u64)k * chan] : 0u;
            const unsigned int hi2 = k + 1 < left ? src[(wl_u64)(k + 1) * chan] : 0u;
            v[k / 2] = lo | (hi2 << 16);
        }
    }
    return make_uint4(v[0], v[1], v[2], v[3]);
}

WL_DEVICE void cv_store_input(wl_bf16* xs, int npix, int i, uint4 v) {
    const int p = i % npix, q = i / npix;
    *(uint4*)(xs + p * CV_PITCH + q * 8) = v;
}

// The products of one stage: every spatial tap, two k16 steps each.
template <int MT>
WL_DEVICE void cv_products(float (*acc)[4][4], const wl_bf16* xs, const wl_bf16* ws, const int* pix, int arow, int acol,
                           int lm, int taps2, int kw, int iw_ext, int bm) {
    for (int s = 0; s < taps2; ++s) {
        const int shift = (s / kw) * iw_ext + s % kw;
        unsigned int af[MT][2][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
            const wl_bf16* ar = ws + (s * bm + arow + i * 16) * CV_PITCH + acol;
            wl_ldmatrix_x4(af[i][0], ar);
            wl_ldmatrix_x4(af[i][1], ar + 16);
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            unsigned int b[4];
            wl_ldmatrix_x4(b, xs + (pix[j] + shift) * CV_PITCH + lm * 8);
#pragma unroll
            for (int i = 0; i < MT; ++i) {
                wl_mma_16816(acc[i][j], af[i][0], b);
                wl_mma_16816(acc[i][j], af[i][1], b + 2);
            }
        }
    }
}

// The next stage (temporal tap a, channel chunk c0) after (a, c0) whose input frame exists;
// a = kt when none is left.
WL_DEVICE void cv_next_stage(const CvGeom& g, int ot, int& a, int& c0) {
    c0 += CV_CK;
    if (c0 >= g.cinp) {
        c0 = 0;
        ++a;
    }
    while (a < g.kt) {
        const int it = ot * g.st + a - g.pt;
        if (it >= 0 && it < g.ti) break;
        ++a;
    }
}

template <int BM>
WL_DEVICE void conv_igemm(wl_bf16* out, const wl_bf16* x, const wl_bf16* wp, const float* bias, const wl_bf16* res,
                          const CvGeom g, int act) {
    constexpr int WM = BM >= 64 ? 2 : 1;
    constexpr int MT = BM / 16 / WM;
    constexpr int WN = 8 / WM;
    constexpr int TH = 2 * WN;
    extern __shared__ __align__(16) unsigned char cv_smem[];
    const int ih_ext = (TH - 1) * g.sh + g.kh, iw_ext = (CV_TW - 1) * g.sw + g.kw;
    const int npix = ih_ext * iw_ext;
    const int taps2 = g.kh * g.kw;
    wl_bf16* xs = (wl_bf16*)cv_smem;      // [npix][CV_PITCH]
    wl_bf16* ws = xs + npix * CV_PITCH;   // [taps2][BM][CV_PITCH]

    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int wm = warp % WM, wn = warp / WM;
    const int mblocks = g.coutp / BM;
    const int ot = blockIdx.z / mblocks, o0 = (blockIdx.z % mblocks) * BM;
    const int oy0 = blockIdx.y * TH, ox0 = blockIdx.x * CV_TW;
    const int iy0 = oy0 * g.sh - g.ph, ix0 = ox0 * g.sw - g.pw;

    float acc[MT][4][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;

    // ldmatrix rows: lane l serves matrix l/8, row l%8. B: n8 group j of this warp is output
    // row 2·wn + j/2, columns (j%2)·8 .. +8; its pixel at spatial tap (0, 0):
    const int lm = lane / 8, lr = lane % 8;
    int pix[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) pix[j] = (2 * wn + j / 2) * g.sh * iw_ext + ((j % 2) * 8 + lr) * g.sw;
    const int arow = wm * MT * 16 + lr + (lm % 2) * 8, acol = (lm / 2) * 8;

    // Stages: (temporal tap, channel chunk) pairs whose input frame exists (frames in the
    // padding contribute nothing; the same for the whole block).
    int a = 0, c0 = -CV_CK;
    cv_next_stage(g, ot, a, c0);
    for (; a < g.kt; cv_next_stage(g, ot, a, c0)) {
        const int it = ot * g.st + a - g.pt;
        __syncthreads();  // everyone is done with the previous stage
        cv_stage_weights<BM>(ws, wp, g, a, c0, o0);
        wl_cp_async_commit();
        for (int i = threadIdx.x; i < npix * 4; i += blockDim.x)
            cv_store_input(xs, npix, i, cv_load_input(x, g, it, c0, iy0, ix0, iw_ext, npix, i));
        wl_cp_async_wait_all();
        __syncthreads();
        cv_products<MT>(acc, xs, ws, pix, arow, acol, lm, taps2, g.kw, iw_ext, BM);
    }
    // Epilogue: bias, residual, activation, bf16; two neighbouring pixels per store where aligned.
    const int gq = lane / 4, cq = (lane % 4) * 2;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
            const int o = o0 + wm * MT * 16 + i * 16 + gq + hh * 8;
            if (o >= g.cout) continue;
            const float bv = bias ? bias[o] : 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int oy = oy0 + 2 * wn + j / 2, ox = ox0 + (j % 2) * 8 + cq;
                if (oy >= g.ho || ox >= g.wo) continue;
                const wl_u64 at = (((wl_u64)o * g.to + ot) * g.ho + oy) * g.wo + ox;
                float v0 = acc[i][j][2 * hh] + bv, v1 = acc[i][j][2 * hh + 1] + bv;
                if (res) {
                    v0 += wl_ld(res, at);
                    if (ox + 1 < g.wo) v1 += wl_ld(res, at + 1);
                }
                if (act == 1) {
                    v0 = v0 != v0 ? v0 : fmaxf(v0, 0.0f);
                    v1 = v1 != v1 ? v1 : fmaxf(v1, 0.0f);
                }
                if (ox + 1 < g.wo && (at & 1) == 0) {
                    *(unsigned int*)(out + at) = wl_pack_bf16(v0, v1);
                } else {
                    out[at] = wl_to_bf16(v0);
                    if (ox + 1 < g.wo) out[at + 1] = wl_to_bf16(v1);
                }
            }
        }
    }
}

// `occ` blocks per SM: the register budget (2 → ≤ 128 registers, 3 → ≤ 80).
#define WL_CONV_IGEMM(BM, occ, name)                                                                       \
    WL_KERNEL void __launch_bounds__(256, occ)                                                             \
        name(wl_bf16* out, const wl_bf16* x, const wl_bf16* wp, const float* bias, const wl_bf16* res,     \
             int cin, int cinp, int ti, int hi, int wi, int kt, int kh, int kw, int st, int sh, int sw,    \
             int pt, int ph, int pw, int cout, int coutp, int to, int ho, int wo, int act) {               \
        const CvGeom g = {cin, cinp, ti, hi, wi, kt, kh, kw, st, sh, sw, pt, ph, pw, cout, coutp, to, ho, wo}; \
        conv_igemm<BM>(out, x, wp, bias, res, g, act);                                                     \
    }

WL_CONV_IGEMM(16, 2, conv_igemm_bf16_m16)
WL_CONV_IGEMM(64, 3, conv_igemm_bf16_m64)
#endif
