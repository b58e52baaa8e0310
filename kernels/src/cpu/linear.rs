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

/// Rows to run a product of `m` rows with: `m`, or more when `m` is small enough for the `gemm`
/// crate to leave its blocked kernel. Its special paths (a matrix-vector kernel for one row,
/// dot-product kernels when `m·n ≤ 256`, `kc = min(k, 512)` instead of `k` split evenly when
/// `m, n ≤ 64`) sum in another order, so a row's bits would depend on how many rows came with
/// it; sequence parallelism computes a chunk's rows in shards and must match one card bit for bit.
fn stable_rows(m: usize, k: usize, n: usize) -> usize {
    let mut rows = m.max(2);
    if rows * n <= 256 {
        rows = 256 / n.max(1) + 1;
    }
    if n <= 64 && k > 512 && rows <= 64 {
        rows = 65;
    }
    rows
}

/// Runs `product(a, out, rows)` on `m` rows, zero-padded to `stable_rows` when that is more.
fn with_stable_rows(
    a: &[f32],
    out: &mut [f32],
    (m, k, n): (usize, usize, usize),
    product: impl FnOnce(&[f32], &mut [f32], usize),
) {
    let rows = stable_rows(m, k, n);
    if rows == m {
        return product(a, out, m);
    }
    let mut padded = vec![0f32; rows * k];
    padded[..m * k].copy_from_slice(&a[..m * k]);
    let mut wide = vec![0f32; rows * n];
    product(&padded, &mut wide, rows);
    out[..m * n].copy_from_slice(&wide[..m * n]);
}

/// How the right-hand matrix of a product is stored.
#[derive(Clone, Copy)]
enum Rhs {
    /// `[n, k]` row-major, used transposed (a `Linear` weight, attention keys).
    Nk,
    /// `[k, n]` row-major (attention values).
    Kn,
}

/// `out = a · bᵀ` with `a: [m, k]` and `b: [n, k]`, both row-major.
pub fn matmul_nt(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    matmul(a, b, out, (m, k, n), Rhs::Nk)
}

/// `out = a · b` with `a: [m, k]` and `b: [k, n]`, both row-major.
pub fn matmul_nn(a: &[f32], b: &[f32], out: &mut [f32], m: usize, k: usize, n: usize) {
    matmul(a, b, out, (m, k, n), Rhs::Kn)
}

fn matmul(a: &[f32], b: &[f32], out: &mut [f32], (m, k, n): (usize, usize, usize), rhs: Rhs) {
    assert!(a.len() >= m * k && b.len() >= n * k && out.len() >= m * n);
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out[..m * n].fill(0.0);
        return;
    }
    with_stable_rows(a, out, (m, k, n), |a, out, m| {
        gemm_f32(a, b, out, (m, k, n), rhs)
    });
}

fn gemm_f32(a: &[f32], b: &[f32], out: &mut [f32], (m, k, n): (usize, usize, usize), rhs: Rhs) {
    assert!(a.len() >= m * k && b.len() >= n * k && out.len() >= m * n);
    // Column and row strides of the k×n right-hand operand as stored.
    let (rhs_cs, rhs_rs) = match rhs {
        Rhs::Nk => (k as isize, 1),
        Rhs::Kn => (1, n as isize),
    };
    // SAFETY: the asserts above bound every index gemm touches: dst is m×n with row stride n,
    // lhs is m×k with row stride k, rhs is k×n read with the strides of its storage.
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
            rhs_cs,
            rhs_rs,
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
