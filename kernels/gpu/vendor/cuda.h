// Vendor header: CUDA (NVRTC). Maps the names the kernels use onto CUDA's. The kernels include no
// CUDA header: bf16 and fp8 are converted bit by bit in common.cuh, so the same sources compile
// with NVRTC without an include path and with HIP headers older than ROCm 6.2.
#define WL_CUDA 1
#define WL_WARP_SIZE 32
#define WL_DEVICE __device__ __forceinline__
#define WL_KERNEL extern "C" __global__
// Threads a block may have, and the blocks an SM should hold at once (registers per thread are
// capped to fit them).
#define WL_BOUNDS(threads, blocks_per_sm) __launch_bounds__(threads, blocks_per_sm)

WL_DEVICE float wl_shfl_xor(float v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }
WL_DEVICE double wl_shfl_xor(double v, int lane_mask) { return __shfl_xor_sync(0xffffffffu, v, lane_mask); }
// Whether any lane of the warp (wave) has p set: the same answer in every lane.
WL_DEVICE bool wl_any(bool p) { return __any_sync(0xffffffffu, p); }

typedef unsigned long long wl_u64;
WL_DEVICE float wl_shfl(float v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane); }
WL_DEVICE int wl_shfl(int v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane); }
// A bit per lane of a warp: wl_ballot's bit l is lane l's p, the same in every lane;
// wl_lanes_below(l) has the bits of the lanes under l.
typedef unsigned int wl_lanes;
WL_DEVICE wl_lanes wl_ballot(bool p) { return __ballot_sync(0xffffffffu, p); }
WL_DEVICE wl_lanes wl_lanes_below(int lane) { return (1u << lane) - 1; }
WL_DEVICE int wl_popc_lanes(wl_lanes x) { return __popc(x); }

// Two floats to e4m3fn codes in one instruction (sm_89+): round to nearest even, saturating at
// ±448, `lo` in the low byte; the codes of common.cuh's wl_to_e4m3 for every finite value and
// ±inf (NaN: 0x7f for the canonical NaN that f32 arithmetic produces on NVIDIA hardware).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define WL_HAS_CVT_E4M3 1
WL_DEVICE unsigned int wl_cvt_e4m3x2(float lo, float hi) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;\n" : "=h"(r) : "f"(hi), "f"(lo));
    return r;
}
#endif

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

// Two floats to a bf16 pair in one instruction (round to nearest even; `lo` in the low half),
// and 2^x with flush-to-zero: the softmax of the flash kernels runs these once per score, where
// the bit-by-bit conversion of common.cuh costs a dozen integer ops.
WL_DEVICE unsigned int wl_cvt_bf16x2(float lo, float hi) {
    unsigned int r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
WL_DEVICE float wl_exp2_approx(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(r) : "f"(x));
    return r;
}

// Four 8×8 b16 matrices from shared memory (lanes 8m..8m+7 give the row addresses of matrix m).
WL_DEVICE void wl_ldmatrix_x4(unsigned int* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(wl_smem_addr(row)));
}
WL_DEVICE void wl_ldmatrix_x4_trans(unsigned int* r, const void* row) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(wl_smem_addr(row)));
}

// ---- Hopper warpgroup MMA (wgmma), sm_90a only: four warps issue one 64×N×16 product together
// and the tensor cores read shared-memory operands through a descriptor, so no warp stages B
// fragments in registers. Operand tiles use the canonical no-swizzle layout: 8×8 "core
// matrices" of 128 contiguous bytes (8 rows of 16 bytes); `lbo` is the byte distance between
// core matrices adjacent along K, `sbo` along M/N. Accumulators: warp w of the group holds rows
// 16w.. 16w + 15 in the m16n8 C-fragment layout, repeated along N.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define WL_HAS_WGMMA 1
WL_DEVICE unsigned long long wl_wgmma_desc(const void* smem, unsigned int lbo, unsigned int sbo) {
    return (unsigned long long)((wl_smem_addr(smem) & 0x3ffffu) >> 4) |
           ((unsigned long long)((lbo >> 4) & 0x3fffu) << 16) | ((unsigned long long)((sbo >> 4) & 0x3fffu) << 32);
}
// Orders this thread's register writes to accumulators before the next wgmma reads them.
WL_DEVICE void wl_wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
WL_DEVICE void wl_wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
WL_DEVICE void wl_wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Waits until at most the last committed group is still running.
WL_DEVICE void wl_wgmma_wait_one() { asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }
// Makes shared memory written by ordinary stores and cp.async visible to wgmma's operand reads.
WL_DEVICE void wl_fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// ---- Tensor memory accelerator (TMA), sm_90: a bulk copy of a tile described by a tensor map
// (made on the host, passed as a __grid_constant__ parameter) into shared memory, its bytes
// counted on an mbarrier. One thread issues a whole tile, so the copies cost no issue slots of
// the warps doing the math, and many tiles can be in flight (cp.async by every thread topped out
// near 4 TB/s of L2 traffic in our attention).
struct __align__(64) wl_tmap {
    unsigned long long opaque[16];
};
WL_DEVICE void wl_mbar_init(void* bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(wl_smem_addr(bar)), "r"(count) : "memory");
}
// Makes the initialised barriers visible to the TMA unit before any copy signals them.
WL_DEVICE void wl_mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
// This thread's arrival, announcing `bytes` still to come from copies.
WL_DEVICE void wl_mbar_expect_tx(void* bar, unsigned int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(wl_smem_addr(bar)), "r"(bytes)
                 : "memory");
}
// Waits until the barrier's phase `parity` has completed.
WL_DEVICE void wl_mbar_wait(void* bar, int parity) {
    unsigned int done = 0;
    while (!done) {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                     : "=r"(done)
                     : "r"(wl_smem_addr(bar)), "r"(parity)
                     : "memory");
    }
}
// The box of `map` at coordinates (c0, c1, c2), innermost first, into `dst`; parts outside the
// tensor arrive as zeros.
WL_DEVICE void wl_tma_load_3d(void* dst, const wl_tmap* map, int c0, int c1, int c2, void* bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], "
        "[%5];\n" ::"r"(wl_smem_addr(dst)),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(wl_smem_addr(bar))
        : "memory");
}
// A plain arrival (no bytes expected), e.g. a consumer releasing a stage.
WL_DEVICE void wl_mbar_arrive(void* bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(wl_smem_addr(bar)) : "memory");
}
// Named barriers over `threads` threads (id 0 is __syncthreads'): sync waits for the count,
// arrive counts this thread without waiting.
WL_DEVICE void wl_named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
WL_DEVICE void wl_named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Moves registers between warpgroups of a block (every thread of the warpgroup executes it):
// a producer warpgroup that only issues copies gives its share to the ones doing the math.
#define WL_SETMAXNREG_DEC(n) asm volatile("setmaxnreg.dec.sync.aligned.u32 " #n ";\n" ::: "memory")
#define WL_SETMAXNREG_INC(n) asm volatile("setmaxnreg.inc.sync.aligned.u32 " #n ";\n" ::: "memory")
// The same for a five-dimensional map (e.g. tokens viewed as [t, h, w, heads, dims]).
WL_DEVICE void wl_tma_load_5d(void* dst, const wl_tmap* map, int c0, int c1, int c2, int c3, int c4, void* bar) {
    asm volatile(
        "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5, "
        "%6}], [%7];\n" ::"r"(wl_smem_addr(dst)),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(c4), "r"(wl_smem_addr(bar))
        : "memory");
}
// Descriptor of a K-major operand as TMA writes it with 128-byte swizzling: rows of 128 bytes,
// 8-row groups 1024 bytes apart (the tile 1024-byte aligned). A 16-element step along K inside a
// row is +32 bytes on the start address; the hardware applies the swizzle to the final address.
WL_DEVICE unsigned long long wl_wgmma_desc_sw128(const void* smem) {
    return wl_wgmma_desc(smem, 16, 1024) | (1ull << 62);
}
// Descriptor of an MN-major operand (N contiguous) in the same layout: rows of 128 bytes (64
// elements along N) at consecutive K, 8-row groups 1024 bytes apart, and the next 64 columns
// `panel` bytes on. A 16-row step along K is +2048 bytes.
WL_DEVICE unsigned long long wl_wgmma_desc_sw128_mn(const void* smem, unsigned int panel) {
    return wl_wgmma_desc(smem, panel, 1024) | (1ull << 62);
}
// The descriptor `bytes` further on. Only the start address moves (bits 0-13, 16-byte units),
// and a block's shared memory (under 256 KiB) never carries out of that field, so one 32-bit
// add is exact: building each of a tile's wgmma descriptors from its pointer took ~14
// instructions, a sixth of the attention loops.
WL_DEVICE unsigned long long wl_desc_plus(unsigned long long d, unsigned int bytes) {
    const unsigned int lo = (unsigned int)d + (bytes >> 4), hi = (unsigned int)(d >> 32);
    return ((unsigned long long)hi << 32) | lo;
}
// D[64×64] (+)= A[64×16] · B[16×64], both operands K-major in shared memory.
WL_DEVICE void wl_wgmma_64x64x16_ss(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(accumulate));
}
// The same with A from registers (each warp's 16 rows in the m16n8k16 A-fragment layout), e.g. a
// query tile held in registers for a whole kernel, so the product reads only B from shared
// memory.
WL_DEVICE void wl_wgmma_64x64x16_rs(float* d, const unsigned int* a, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}
// D[64×32] (+)= A[64×16] · B[16×32], as above: VSA's key tiles with half their slots in the grid.
WL_DEVICE void wl_wgmma_64x32x16_rs(float* d, const unsigned int* a, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}
// D[64×176] (+)= A[64×16] · B[16×176], both operands K-major in shared memory (the dense
// attention's 176-key tiles, FlashAttention-3's shape for head dim 128).
WL_DEVICE void wl_wgmma_64x176x16_ss(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %90, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n176k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87}, %88, %89, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87])
        : "l"(da), "l"(db), "r"(accumulate));
}
// D[64×128] (+)= A[64×16] · B[16×128], both operands K-major in shared memory.
WL_DEVICE void wl_wgmma_64x128x16_ss(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
}
// D[64×128] (+)= A[64×16] · B[16×128], A from registers, B K-major in shared memory: S = Q·Kᵀ
// with the query tile held in registers (`accumulate` 0 on a product's first K step).
WL_DEVICE void wl_wgmma_64x128x16_rs_p(float* d, const unsigned int* a, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(accumulate));
}
// D[64×128] += A[64×16] · B[16×128], A from registers (each warp's 16 rows in the m16n8k16
// A-fragment layout), B K-major in shared memory.
WL_DEVICE void wl_wgmma_64x128x16_rs(float* d, const unsigned int* a, unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
// The same with B N-major (imm-trans-b): rows of B along K, N contiguous, e.g. V tiles as stored
// ([keys][dims]), so P·V needs no transposed copy of V.
WL_DEVICE void wl_wgmma_64x128x16_rs_nmajor(float* d, const unsigned int* a, unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
// e4m3 operands (wgmma takes fp8 only K-major): D[64×128] (+)= A[64×32] · B[32×128], f32
// accumulators in the layout above. `_ss`: both operands in shared memory; `_rs`: A from
// registers, each warp's 16 rows in the m16n8k32 8-bit A-fragment layout (four bytes a register:
// rows lane/4 and lane/4 + 8, k = 4·(lane%4) + 0..3 and the same + 16).
WL_DEVICE void wl_wgmma_64x128x32_e4m3_ss(float* d, unsigned long long da, unsigned long long db, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(accumulate));
}
WL_DEVICE void wl_wgmma_64x128x32_e4m3_rs(float* d, const unsigned int* a, unsigned long long db) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}
#endif
