// Vendor header: HIP (hipRTC, or clang -x hip). Same names as vendor/cuda.h. CDNA wavefronts are
// 64 lanes: reductions below use WL_WARP_SIZE, and a xor-shuffle with a mask under 32 stays inside
// each 32-lane half, so code written for a logical warp of 32 stays correct on wave64.
#define WL_HIP 1
#define WL_WARP_SIZE 64
#define WL_DEVICE __device__ __forceinline__
#define WL_KERNEL extern "C" __global__
// Threads a block may have; CUDA's blocks-per-SM hint is dropped. HIP reads that second number
// as an occupancy target in waves per SIMD, and for the norm kernels, which keep a row in
// registers, clang then spilled 100–270 VGPRs a thread to scratch (gfx942 and gfx950; without
// it, none). hip_compile.rs fails on any VGPR spill.
#define WL_BOUNDS(threads, blocks_per_sm) __launch_bounds__(threads)

WL_DEVICE float wl_shfl_xor(float v, int lane_mask) { return __shfl_xor(v, lane_mask); }
WL_DEVICE double wl_shfl_xor(double v, int lane_mask) { return __shfl_xor(v, lane_mask); }
// Whether any lane of the warp (wave) has p set: the same answer in every lane.
WL_DEVICE bool wl_any(bool p) { return __any(p); }

typedef unsigned long long wl_u64;
WL_DEVICE float wl_shfl(float v, int src_lane) { return __shfl(v, src_lane); }
WL_DEVICE int wl_shfl(int v, int src_lane) { return __shfl(v, src_lane); }
// A bit per lane of a wave (vendor/cuda.h says what each does).
typedef wl_u64 wl_lanes;
WL_DEVICE wl_lanes wl_ballot(bool p) { return __ballot(p); }
WL_DEVICE wl_lanes wl_lanes_below(int lane) { return (wl_u64(1) << lane) - 1; }
WL_DEVICE int wl_popc_lanes(wl_lanes x) { return __popcll(x); }

// ---- tile level: CDNA's matrix cores. v_mfma_f32_16x16x16_bf16 (the "_1k" encoding: four bf16
// of K per lane) exists from gfx90a on (MI200, MI300, MI350); gfx908 has only the older bf16
// forms, so kernels under WL_HAS_MFMA_BF16 are not built for it. Lane l of the 64 holds, for
// A (16×16, M×K) row l%16 and columns 4·(l/16) .. +3; for B (K×N) column l%16 and rows
// 4·(l/16) .. +3; for C/D (M×N) column l%16 and rows 4·(l/16) .. +3. The CPU emulation of
// kernels/tests/rocm_emu/emu.h (WL_EMU) implements this same layout from that description.
#if defined(WL_EMU) || defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || \
    defined(__gfx950__)
#define WL_HAS_MFMA_BF16 1
#if defined(WL_EMU)
typedef WlEmuBf16x4 wl_bf16x4;
typedef WlEmuF32x4 wl_f32x4;
WL_DEVICE wl_bf16x4 wl_ld_bf16x4(const unsigned short* p) {
    wl_bf16x4 r;
    std::memcpy(&r, p, sizeof r);
    return r;
}
WL_DEVICE wl_f32x4 wl_mfma_16x16x16_bf16(wl_bf16x4 a, wl_bf16x4 b, wl_f32x4 c) {
    return wl_emu_mfma_16x16x16_bf16(a, b, c);
}
#else
typedef short wl_bf16x4 __attribute__((ext_vector_type(4)));
typedef float wl_f32x4 __attribute__((ext_vector_type(4)));
// Four consecutive bf16 from an 8-byte aligned address: one 64-bit load.
WL_DEVICE wl_bf16x4 wl_ld_bf16x4(const unsigned short* p) { return *(const wl_bf16x4*)p; }
WL_DEVICE wl_f32x4 wl_mfma_16x16x16_bf16(wl_bf16x4 a, wl_bf16x4 b, wl_f32x4 c) {
    return __builtin_amdgcn_mfma_f32_16x16x16bf16_1k(a, b, c, 0, 0, 0);
}
#endif

// gfx950 (MI350, MI355X) adds v_mfma_f32_16x16x32_bf16: twice the K per instruction, and the
// rate of CDNA4's bf16 peak (its 16x16x16 form runs at half of it). Lane l holds A[l%16][8·(l/16)
// + i] and B[8·(l/16) + i][l%16] for i = 0..7 (eight bf16 of K, 16 bytes), D as above. The
// emulation implements the same layout; attention.cu's `*_mfma32_*` kernels take it.
#if defined(__gfx950__)
#define WL_HAS_MFMA_K32 1
#if defined(WL_EMU)
typedef WlEmuBf16x8 wl_bf16x8;
WL_DEVICE wl_bf16x8 wl_ld_bf16x8(const unsigned short* p) {
    wl_bf16x8 r;
    std::memcpy(&r, p, sizeof r);
    return r;
}
WL_DEVICE wl_f32x4 wl_mfma_16x16x32_bf16(wl_bf16x8 a, wl_bf16x8 b, wl_f32x4 c) {
    return wl_emu_mfma_16x16x32_bf16(a, b, c);
}
#else
typedef short wl_bf16x8 __attribute__((ext_vector_type(8)));
typedef __bf16 wl_bf16x8_hw __attribute__((ext_vector_type(8)));
// Eight consecutive bf16 from a 16-byte aligned address: one 128-bit load.
WL_DEVICE wl_bf16x8 wl_ld_bf16x8(const unsigned short* p) { return *(const wl_bf16x8*)p; }
WL_DEVICE wl_f32x4 wl_mfma_16x16x32_bf16(wl_bf16x8 a, wl_bf16x8 b, wl_f32x4 c) {
    return __builtin_amdgcn_mfma_f32_16x16x32_bf16(__builtin_bit_cast(wl_bf16x8_hw, a),
                                                   __builtin_bit_cast(wl_bf16x8_hw, b), c, 0, 0, 0);
}
#endif
#endif

// v_mfma_f32_16x16x32_fp8_fp8 (gfx940 on): eight e4m3 codes of K a lane in 64 bits (byte i is
// element i), the lanes as the bf16 16x16x32 form. gfx950's e4m3 is OCP e4m3fn, our codes;
// gfx94x's is fnuz (exponent bias 8, NaN at 0x80): WL_MFMA_FP8_FNUZ, and the kernels pass our
// codes as fnuz codes of half the value (attention_fp8.cu's f8m_device).
#if defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__) || defined(__gfx950__)
#define WL_HAS_MFMA_FP8 1
#if !defined(__gfx950__)
#define WL_MFMA_FP8_FNUZ 1
#endif
#if defined(WL_EMU)
typedef unsigned long long wl_fp8x8;
WL_DEVICE wl_f32x4 wl_mfma_16x16x32_fp8(wl_fp8x8 a, wl_fp8x8 b, wl_f32x4 c) {
#if defined(WL_MFMA_FP8_FNUZ)
    return wl_emu_mfma_16x16x32_fp8(a, b, c, true);
#else
    return wl_emu_mfma_16x16x32_fp8(a, b, c, false);
#endif
}
#else
typedef long wl_fp8x8;
WL_DEVICE wl_f32x4 wl_mfma_16x16x32_fp8(wl_fp8x8 a, wl_fp8x8 b, wl_f32x4 c) {
    return __builtin_amdgcn_mfma_f32_16x16x32_fp8_fp8(a, b, c, 0, 0, 0);
}
#endif
#endif
#endif
