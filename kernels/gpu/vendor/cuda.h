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
WL_DEVICE int wl_shfl(int v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane); }

// ---- tile level (tensor cores): the only place vendor matrix instructions appear.
#define WL_HAS_MMA_BF16 1
// D[16×8] += A[16×16] · B[16×8], bf16 operands, f32 accumulators (mma.sync.m16n8k16, sm_80+).
// Fragment layouts are PTX's: a0..a3 / b0..b1 hold two bf16 each; c0..c3 are rows lane/4 and
// lane/4 + 8, columns 2·(lane%4) + {0, 1}.
WL_DEVICE void wl_mma_16816(float* c, const unsigned int* a, const unsigned int* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Loads the B fragment of one m16n8k16 step from a row-major [k][n] tile in shared memory:
// lanes 0-15 give the addresses of rows 0-15 (8 contiguous b16 each); .trans hands each thread
// the column pairs the B operand wants.
WL_DEVICE void wl_ldmatrix_x2_trans(unsigned int* r, const void* row) {
    unsigned int addr;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }\n" : "=r"(addr) : "l"(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n" : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
}

// Asynchronous 16-byte global → shared copy (sm_80+); `valid == false` writes zeros instead and
// reads nothing, which masks the tail of a tile.
WL_DEVICE unsigned int wl_smem_addr(const void* p) {
    unsigned int addr;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }\n" : "=r"(addr) : "l"(p));
    return addr;
}
WL_DEVICE void wl_cp_async16(void* smem, const void* gmem, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(wl_smem_addr(smem)), "l"(gmem), "r"(valid ? 16 : 0));
}
WL_DEVICE void wl_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
// Waits until at most one committed group is still in flight.
WL_DEVICE void wl_cp_async_wait_one() { asm volatile("cp.async.wait_group 1;\n" ::); }
WL_DEVICE void wl_cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }

// Four 8×8 b16 matrices from shared memory (lanes 8m..8m+7 give the row addresses of matrix m).
WL_DEVICE void wl_ldmatrix_x4(unsigned int* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(wl_smem_addr(row)));
}
WL_DEVICE void wl_ldmatrix_x4_trans(unsigned int* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(wl_smem_addr(row)));
}
