// Vendor header: HIP (hipRTC, or clang -x hip). Same names as vendor/cuda.h. CDNA wavefronts are
// 64 lanes: reductions below use WL_WARP_SIZE, and a xor-shuffle with a mask under 32 stays inside
// each 32-lane half, so code written for a logical warp of 32 stays correct on wave64.
#define WL_HIP 1
#define WL_WARP_SIZE 64
#define WL_DEVICE __device__ __forceinline__
#define WL_KERNEL extern "C" __global__

WL_DEVICE float wl_shfl_xor(float v, int lane_mask) { return __shfl_xor(v, lane_mask); }
WL_DEVICE double wl_shfl_xor(double v, int lane_mask) { return __shfl_xor(v, lane_mask); }

typedef unsigned long long wl_u64;
WL_DEVICE float wl_shfl(float v, int src_lane) { return __shfl(v, src_lane); }
WL_DEVICE int wl_shfl(int v, int src_lane) { return __shfl(v, src_lane); }

// ---- tile level: CDNA's MFMA path is not written yet, so kernels that need
// WL_HAS_MMA_BF16 are compiled only for CUDA and HIP uses the portable kernels.
