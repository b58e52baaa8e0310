// Device side of the CPU emulation of a wave64 AMD GPU (tests only: kernels/tests/rocm_emulated.rs).
// Included before a HIP kernel unit (vendor/hip.h + common.cuh + module) compiled as plain C++:
// each block runs as a team of OS threads, __syncthreads is a barrier, a wavefront's shuffles
// exchange through the team, and __shared__ variables are statics (blocks run one at a time).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <utility>

struct dim3 {
    unsigned x, y, z;
};

// What the runtime hands each emulated thread (kept in step with runtime.cpp).
struct WlEmuCtx {
    dim3 thread, block, block_dim, grid_dim;
    void* team;
    void (*sync)(void* team);
    void (*exchange)(void* team, unsigned tid, const void* in, void* out, int bytes, int src_lane);
    void* dyn_smem;
    // All 64 lanes of the caller's wavefront hand in `bytes` (≤ 32) and each gets every lane's,
    // lane by lane: one step of the team for a whole-wave instruction (MFMA).
    void (*gather)(void* team, unsigned tid, const void* in, void* out, int bytes);
};

inline thread_local const WlEmuCtx* wl_emu_ctx = nullptr;
inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __restrict__
#define __syncthreads() wl_emu_ctx->sync(wl_emu_ctx->team)
#define WL_EMU_DYN_SMEM(T) reinterpret_cast<T*>(wl_emu_ctx->dyn_smem)

template <typename T>
inline T wl_emu_shuffle(T v, int src_lane) {
    T out;
    wl_emu_ctx->exchange(wl_emu_ctx->team, threadIdx.x, &v, &out, (int)sizeof(T), src_lane);
    return out;
}
template <typename T>
inline T __shfl_xor(T v, int mask, int = 64) {
    return wl_emu_shuffle(v, (int)(threadIdx.x % 64) ^ mask);
}
template <typename T>
inline T __shfl(T v, int src, int = 64) {
    return wl_emu_shuffle(v, src % 64);
}

// Whether any lane of the caller's wavefront has p set (every lane must call it, as on the GPU).
inline int __any(int p) {
    int all[64];
    wl_emu_ctx->gather(wl_emu_ctx->team, threadIdx.x, &p, all, (int)sizeof(int));
    for (int i = 0; i < 64; ++i)
        if (all[i]) return 1;
    return 0;
}

// Bit l: lane l's p (every lane must call it).
inline unsigned long long __ballot(int p) {
    int all[64];
    wl_emu_ctx->gather(wl_emu_ctx->team, threadIdx.x, &p, all, (int)sizeof(int));
    unsigned long long m = 0;
    for (int i = 0; i < 64; ++i) m |= (unsigned long long)(all[i] != 0) << i;
    return m;
}
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }

inline float __uint_as_float(unsigned u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    return u;
}
// Blocks run one at a time, but a block's threads are OS threads: device atomics and fences as
// the host's.
inline unsigned atomicAdd(unsigned* p, unsigned v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }

using std::max;
using std::min;
inline int min(int a, unsigned b) { return a < (int)b ? a : (int)b; }

struct uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(16) float4 {
    float x, y, z, w;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

// CDNA's matrix-core operands and products (vendor/hip.h's wl_mfma_16x16x16_bf16 and gfx950's
// wl_mfma_16x16x32_bf16), written from AMD's register layout (below).
#define WL_EMU 1
struct WlEmuBf16x4 {
    short v[4];
    short& operator[](int i) { return v[i]; }
    short operator[](int i) const { return v[i]; }
};
struct WlEmuF32x4 {
    float v[4];
    float& operator[](int i) { return v[i]; }
    float operator[](int i) const { return v[i]; }
};
inline float wl_emu_bf16_value(short b) {
    const unsigned u = (unsigned)(unsigned short)b << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
// D = A·B + C over one 16×16 output, K = 4·KW: lane l holds A[l%16][KW·(l/16)+i] and
// B[KW·(l/16)+i][l%16] for i < KW, D[4·(l/16)+i][l%16] for i < 4. Products of bf16 are exact
// in f32; sums go in K order.
template <int KW, typename Frag>
inline WlEmuF32x4 wl_emu_mfma_16x16(Frag a, Frag b, WlEmuF32x4 c) {
    struct Operands {
        Frag a, b;
    } mine{a, b}, all[64];
    wl_emu_ctx->gather(wl_emu_ctx->team, threadIdx.x, &mine, all, (int)sizeof(Operands));
    const int lane = (int)(threadIdx.x % 64), col = lane % 16, grp = lane / 16;
    WlEmuF32x4 d = c;
    for (int i = 0; i < 4; ++i) {
        const int row = 4 * grp + i;
        float acc = c[i];
        for (int k = 0; k < 4 * KW; ++k)
            acc += wl_emu_bf16_value(all[row + 16 * (k / KW)].a[k % KW]) *
                   wl_emu_bf16_value(all[col + 16 * (k / KW)].b[k % KW]);
        d[i] = acc;
    }
    return d;
}
inline WlEmuF32x4 wl_emu_mfma_16x16x16_bf16(WlEmuBf16x4 a, WlEmuBf16x4 b, WlEmuF32x4 c) {
    return wl_emu_mfma_16x16<4>(a, b, c);
}

// gfx950's v_mfma_f32_16x16x32_bf16: eight bf16 of K per lane.
struct WlEmuBf16x8 {
    short v[8];
    short& operator[](int i) { return v[i]; }
    short operator[](int i) const { return v[i]; }
};
inline WlEmuF32x4 wl_emu_mfma_16x16x32_bf16(WlEmuBf16x8 a, WlEmuBf16x8 b, WlEmuF32x4 c) {
    // WORLDLINE_ROCM_EMU_BAD_MFMA32=1: hardware whose lane layout is not the one assumed (A's
    // eight values in the other order), for the start-up check's fallback test.
    const char* bad = std::getenv("WORLDLINE_ROCM_EMU_BAD_MFMA32");
    if (bad && bad[0] == '1')
        for (int i = 0; i < 4; ++i) std::swap(a.v[i], a.v[7 - i]);
    return wl_emu_mfma_16x16<8>(a, b, c);
}

// v_mfma_f32_16x16x32_fp8_fp8: eight e4m3 codes of K per lane in a 64-bit word (byte i is
// element i), the lanes as above; each code decoded from the format's definition: OCP (gfx950;
// bias 7, NaN at S.1111.111) or fnuz (gfx94x; bias 8, NaN only at 0x80, no negative zero).
inline float wl_emu_e4m3_value(unsigned c, bool fnuz) {
    if (fnuz ? c == 0x80 : (c & 0x7f) == 0x7f) return std::nanf("");
    const int e = (c >> 3) & 15, m = c & 7, bias = fnuz ? 8 : 7;
    const float mag = e == 0 ? std::ldexp((float)m / 8.0f, 1 - bias) : std::ldexp(1.0f + (float)m / 8.0f, e - bias);
    return (c & 0x80) ? -mag : mag;
}
inline WlEmuF32x4 wl_emu_mfma_16x16x32_fp8(unsigned long long a, unsigned long long b, WlEmuF32x4 c, bool fnuz) {
    struct Operands {
        unsigned long long a, b;
    } mine{a, b}, all[64];
    wl_emu_ctx->gather(wl_emu_ctx->team, threadIdx.x, &mine, all, (int)sizeof(Operands));
    const int lane = (int)(threadIdx.x % 64), col = lane % 16, grp = lane / 16;
    auto code = [](unsigned long long w, int i) { return (unsigned)((w >> (8 * i)) & 0xff); };
    WlEmuF32x4 d = c;
    for (int i = 0; i < 4; ++i) {
        const int row = 4 * grp + i;
        float acc = c[i];
        for (int k = 0; k < 32; ++k)
            acc += wl_emu_e4m3_value(code(all[row + 16 * (k / 8)].a, k % 8), fnuz) *
                   wl_emu_e4m3_value(code(all[col + 16 * (k / 8)].b, k % 8), fnuz);
        d[i] = acc;
    }
    return d;
}

// A kernel's entry for the runtime: set this thread's indices, unpack the launch's argument
// pointers into the kernel's parameters.
inline void wl_emu_enter(const WlEmuCtx* c) {
    wl_emu_ctx = c;
    threadIdx = c->thread;
    blockIdx = c->block;
    blockDim = c->block_dim;
    gridDim = c->grid_dim;
}
template <typename... A, std::size_t... I>
void wl_emu_call_impl(void (*f)(A...), void** p, std::index_sequence<I...>) {
    f(*static_cast<std::remove_reference_t<A>*>(p[I])...);
}
template <typename... A>
void wl_emu_call(void (*f)(A...), void** p) {
    wl_emu_call_impl(f, p, std::index_sequence_for<A...>{});
}
#define WL_EMU_REGISTER(name)                                              \
    extern "C" void wl_emu_##name(void** p, const WlEmuCtx* c) {          \
        wl_emu_enter(c);                                                   \
        wl_emu_call(name, p);                                              \
    }
