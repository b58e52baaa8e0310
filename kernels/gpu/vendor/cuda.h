// Vendor header: CUDA (NVRTC). Maps the names the kernels use onto CUDA's. The kernels include no
// CUDA header: bf16 and fp8 are converted bit by bit in common.cuh, so the same sources compile
// with NVRTC without an include path and with HIP headers older than ROCm 6.2.
#define WL_CUDA 1
#define WL_WARP_SIZE 32
#define WL_DEVICE __device__ __forceinline__
#define WL_KERNEL extern "C" __global__

WL_DEVICE float wl_shfl_xor(float v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }
WL_DEVICE double wl_shfl_xor(double v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }

typedef unsigned long long wl_u64;
WL_DEVICE float wl_shfl(float v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane); }
