use gemm::Parallelism;

/// `out[m, n] = sum_k x[m, k] * w[n, k]` (+ `bias[n]`): a PyTorch `Linear` with `w` as `[out, in]`.
pub fn linear(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    m: usize,
    k: usize,
    n: usize,
) -> Vec<f32> {
    let mut out = vec![0f32; m * n];
    matmul_nt(x, w, &mut out, m, k, n);
    if let Some(b) = bias {
        for row in out.chunks_mut(n) {
            for (o, b) in row.iter_mut().zip(b) {
                *o += b;
            }
        }
    }
    out
}

/// `out = a · bᵀ` with `a: [m, k]` and `b: [n, k]`, both row-major.
pub fn matmul_nt(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    assert!(a.len() >= m * k && b.len() >= n * k && out.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out[..m * n].fill(0.0);
        return;
    }
    // SAFETY: the asserts above bound every index gemm touches: dst is m×n with row stride n,
    // lhs is m×k with row stride k, rhs (bᵀ) is k×n read with row stride 1 and column stride k.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            k as isize,
            1,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism(),
        )
    }
}

/// `out = a · b` with `a: [m, k]` and `b: [k, n]`, both row-major.
pub fn matmul_nn(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    assert!(a.len() >= m * k && b.len() >= k * n && out.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out[..m * n].fill(0.0);
        return;
    }
    // SAFETY: as in `matmul_nt`; rhs is k×n with row stride n and column stride 1.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            1,
            n as isize,
            0.0,
            1.0,
            false,
            false,
            false,
            parallelism(),
        )
    }
}

fn parallelism() -> Parallelism {
    match rayon::current_num_threads() {
        0 | 1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}
