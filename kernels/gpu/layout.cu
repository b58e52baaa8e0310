// Data movement by element width: 2-D strided copies (narrow, cat, cache rows) and permutes.

template <typename E>
WL_DEVICE void copy2d(E* dst, wl_u64 dst_pitch, const E* src, wl_u64 src_pitch, wl_u64 rows, wl_u64 cols) {
    WL_GRID_STRIDE(i, rows * cols) {
        const wl_u64 r = i / cols, c = i % cols;
        dst[r * dst_pitch + c] = src[r * src_pitch + c];
    }
}

// 16 bytes moved as one, for copies whose offsets, pitches and widths are multiples of 16 bytes
// (Ulysses' head slices, cache rows, concatenations of whole rows): one load and store per 8
// bf16 instead of 8, and a 2-D grid so no thread divides.
struct alignas(16) wl_v16 {
    unsigned int x, y, z, w;
};

WL_KERNEL void copy2d_v16(wl_v16* dst, wl_u64 dst_pitch, const wl_v16* src, wl_u64 src_pitch, wl_u64 rows, wl_u64 cols) {
    for (wl_u64 r = blockIdx.y; r < rows; r += gridDim.y) {
        for (wl_u64 c = (wl_u64)blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += (wl_u64)gridDim.x * blockDim.x) {
            dst[r * dst_pitch + c] = src[r * src_pitch + c];
        }
    }
}

// `dims` are the output's sizes; `strides` the input strides of those output dims.
template <typename E>
WL_DEVICE void permute(E* dst, const E* src, wl_u64 n, int rank, const wl_u64* dims, const wl_u64* strides) {
    WL_GRID_STRIDE(i, n) {
        wl_u64 rest = i, off = 0;
        for (int d = rank - 1; d >= 0; --d) {
            off += (rest % dims[d]) * strides[d];
            rest /= dims[d];
        }
        dst[i] = src[off];
    }
}

// Rows `ids` of `src` (rows of `cols`, ids checked on the host) into consecutive rows of `dst`:
// an embedding lookup in one launch.
template <typename E>
WL_DEVICE void gather_rows(E* dst, const E* src, const wl_u64* ids, wl_u64 rows, wl_u64 cols) {
    WL_GRID_STRIDE(i, rows * cols) { dst[i] = src[ids[i / cols] * cols + i % cols]; }
}

#define WL_LAYOUT(E, bits)                                                                                      \
    WL_KERNEL void copy2d_b##bits(E* dst, wl_u64 dst_pitch, const E* src, wl_u64 src_pitch, wl_u64 rows, wl_u64 cols) { \
        copy2d(dst, dst_pitch, src, src_pitch, rows, cols);                                                     \
    }                                                                                                           \
    WL_KERNEL void permute_b##bits(E* dst, const E* src, wl_u64 n, int rank, const wl_u64* dims, const wl_u64* strides) { \
        permute(dst, src, n, rank, dims, strides);                                                              \
    }                                                                                                           \
    WL_KERNEL void gather_rows_b##bits(E* dst, const E* src, const wl_u64* ids, wl_u64 rows, wl_u64 cols) {     \
        gather_rows(dst, src, ids, rows, cols);                                                                 \
    }

WL_LAYOUT(unsigned char, 8)
WL_LAYOUT(unsigned short, 16)
WL_LAYOUT(unsigned int, 32)
WL_LAYOUT(wl_v16, 128)
