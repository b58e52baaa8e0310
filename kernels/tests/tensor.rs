//! Data movement and dtype conversion on `Tensor`, against index arithmetic written out here.

mod common;

use common::{assert_bits_eq, assert_err_names, randn, tensor, Rng};
use half::{bf16, f16};
use kernels::{ops, DType, Device, Result, ScaleKind, Tensor};

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// The multi-index of flat position `i` in `shape`.
fn unravel(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        idx[d] = i % shape[d];
        i /= shape[d];
    }
    idx
}

fn offset(idx: &[usize], shape: &[usize]) -> usize {
    idx.iter().zip(strides(shape)).map(|(i, s)| i * s).sum()
}

fn narrow(dev: Device) -> Result<()> {
    let mut rng = Rng::new(30);
    let shape = [4, 5, 6];
    let x = randn(dev, &mut rng, &shape)?;
    let xv = x.to_vec_f32();
    for dim in 0..3 {
        for (start, len) in [(0, 1), (1, 2), (0, shape[dim]), (shape[dim] - 1, 1)] {
            let y = x.narrow(dim, start, len)?;
            let mut ys = shape.to_vec();
            ys[dim] = len;
            assert_eq!(y.shape(), &ys[..]);
            let want: Vec<f32> = (0..y.elem_count())
                .map(|i| {
                    let mut idx = unravel(i, &ys);
                    idx[dim] += start;
                    xv[offset(&idx, &shape)]
                })
                .collect();
            assert_bits_eq(
                &format!("narrow {dim} {start} {len}"),
                &y.to_vec_f32(),
                &want,
            );
        }
    }
    let xb = x.to_dtype(DType::BF16)?;
    let yb = xb.narrow(1, 2, 3)?;
    assert_eq!(yb.dtype(), DType::BF16);
    let want = x.narrow(1, 2, 3)?.to_dtype(DType::BF16)?;
    assert_bits_eq("narrow bf16", &yb.to_vec_f32(), &want.to_vec_f32());

    assert_err_names(x.narrow(1, 3, 3), "narrow");
    assert_err_names(x.narrow(3, 0, 1), "narrow");
    let q = ops::quantize_fp8(&x, ScaleKind::Tensorwise)?;
    assert_err_names(q.narrow(0, 0, 1), "narrow");
    Ok(())
}
test_device!(narrow, narrow_cpu);

fn cat(dev: Device) -> Result<()> {
    let mut rng = Rng::new(31);
    let base = [3, 4, 5];
    for dim in 0..3 {
        let sizes = [2, 1, 3];
        let parts: Vec<Tensor> = sizes
            .iter()
            .map(|&s| {
                let mut sh = base.to_vec();
                sh[dim] = s;
                randn(dev, &mut rng, &sh)
            })
            .collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = parts.iter().collect();
        let y = Tensor::cat(&refs, dim)?;
        let mut ys = base.to_vec();
        ys[dim] = sizes.iter().sum();
        assert_eq!(y.shape(), &ys[..]);
        let want: Vec<f32> = (0..y.elem_count())
            .map(|i| {
                let mut idx = unravel(i, &ys);
                let mut p = 0;
                while idx[dim] >= sizes[p] {
                    idx[dim] -= sizes[p];
                    p += 1;
                }
                parts[p].to_vec_f32()[offset(&idx, parts[p].shape())]
            })
            .collect();
        assert_bits_eq(&format!("cat dim {dim}"), &y.to_vec_f32(), &want);
    }
    let a = randn(dev, &mut rng, &[2, 3])?;
    let b = randn(dev, &mut rng, &[2, 4])?;
    assert_err_names(Tensor::cat(&[&a, &b], 0), "cat");
    assert_err_names(Tensor::cat(&[&a, &a], 2), "cat");
    assert_err_names(Tensor::cat(&[], 0), "cat");
    let ab = a.to_dtype(DType::BF16)?;
    assert_err_names(Tensor::cat(&[&a, &ab], 0), "cat");
    let c = Tensor::cat(&[&ab, &ab], 1)?;
    assert_eq!((c.dtype(), c.shape()), (DType::BF16, &[2usize, 6][..]));
    Ok(())
}
test_device!(cat, cat_cpu);

fn permute(dev: Device) -> Result<()> {
    let mut rng = Rng::new(32);
    let shape = [2, 3, 4, 5];
    let x = randn(dev, &mut rng, &shape)?;
    let xv = x.to_vec_f32();
    for perm in [[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], [0, 2, 3, 1]] {
        let y = x.permute(&perm)?;
        let ys: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
        assert_eq!(y.shape(), &ys[..]);
        // Output index `o` reads input index `i` with `i[perm[d]] = o[d]`.
        let want: Vec<f32> = (0..y.elem_count())
            .map(|n| {
                let o = unravel(n, &ys);
                let mut i = [0; 4];
                for d in 0..4 {
                    i[perm[d]] = o[d];
                }
                xv[offset(&i, &shape)]
            })
            .collect();
        assert_bits_eq(&format!("permute {perm:?}"), &y.to_vec_f32(), &want);
        // Applying the inverse permutation restores the input.
        let mut inv = [0; 4];
        for (d, &p) in perm.iter().enumerate() {
            inv[p] = d;
        }
        assert_bits_eq("permute inverse", &y.permute(&inv)?.to_vec_f32(), &xv);
    }
    assert_err_names(x.permute(&[0, 1, 1, 2]), "permute");
    assert_err_names(x.permute(&[0, 1, 2]), "permute");
    assert_err_names(x.permute(&[0, 1, 2, 4]), "permute");
    Ok(())
}
test_device!(permute, permute_cpu);

fn reshape(dev: Device) -> Result<()> {
    let mut rng = Rng::new(33);
    let x = randn(dev, &mut rng, &[4, 6])?;
    let y = x.reshape(&[2, 3, 4])?;
    assert_eq!(y.shape(), &[2, 3, 4]);
    assert_bits_eq("reshape", &y.to_vec_f32(), &x.to_vec_f32());
    if dev.is_cpu() {
        // Documented as sharing the storage, not copying it.
        assert!(std::ptr::eq(x.cpu_f32().as_ptr(), y.cpu_f32().as_ptr()));
    }
    assert_err_names(x.reshape(&[5, 5]), "reshape");
    let rows = ops::quantize_fp8(&x, ScaleKind::Rowwise)?;
    assert_err_names(rows.reshape(&[6, 4]), "reshape");
    // Keeping the row length keeps every row's scale meaning.
    let r = rows.reshape(&[2, 2, 6])?;
    assert_bits_eq("fp8 reshape", &r.to_vec_f32(), &rows.to_vec_f32());
    let whole = ops::quantize_fp8(&x, ScaleKind::Tensorwise)?;
    let r = whole.reshape(&[6, 4])?;
    assert_bits_eq(
        "fp8 tensorwise reshape",
        &r.to_vec_f32(),
        &whole.to_vec_f32(),
    );
    Ok(())
}
test_device!(reshape, reshape_cpu);

fn to_dtype(dev: Device) -> Result<()> {
    let mut rng = Rng::new(34);
    let mut data = rng.normals(64, 3.0);
    // Exact ties (to even: down, then up) and a value past f16's range.
    let one = 1.0f32;
    data.extend([
        one + 2f32.powi(-8),
        one + 3.0 * 2f32.powi(-8),
        one + 2f32.powi(-11),
        one + 3.0 * 2f32.powi(-11),
        1e6,
    ]);
    let x = tensor(dev, data.clone(), &[data.len()])?;
    let b = x.to_dtype(DType::BF16)?;
    assert_eq!(b.dtype(), DType::BF16);
    let want: Vec<f32> = data.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    assert_bits_eq("to bf16", &b.to_vec_f32(), &want);
    let n = data.len();
    assert_eq!(b.to_vec_f32()[n - 5..n - 3], [1.0, one + 2f32.powi(-6)]);
    let h = x.to_dtype(DType::F16)?;
    let want: Vec<f32> = data.iter().map(|&v| f16::from_f32(v).to_f32()).collect();
    assert_bits_eq("to f16", &h.to_vec_f32(), &want);
    assert_eq!(h.to_vec_f32()[n - 3..n - 1], [1.0, one + 2f32.powi(-9)]);
    assert_eq!(h.to_vec_f32()[n - 1], f32::INFINITY);
    // Widening is exact, and converting to the same dtype changes nothing.
    let back = b.to_dtype(DType::F32)?;
    assert_eq!(back.dtype(), DType::F32);
    assert_bits_eq("bf16 to f32", &back.to_vec_f32(), &b.to_vec_f32());
    assert_bits_eq("f32 to f32", &x.to_dtype(DType::F32)?.to_vec_f32(), &data);
    assert_err_names(x.to_dtype(DType::F8E4M3), "to_dtype");
    Ok(())
}
test_device!(to_dtype, to_dtype_cpu);

#[test]
fn assemble_places_pieces_and_zeroes_the_rest() {
    use kernels::ops::Piece;
    // a: 2 rows × 3 cols (as [2, 3]); b: 3 rows × 2 cols viewed from [3, 1, 2].
    let a = Tensor::from_vec(vec![1., 2., 3., 4., 5., 6.], &[2, 3]).expect("a");
    let b = Tensor::from_vec(vec![7., 8., 9., 10., 11., 12.], &[3, 1, 2]).expect("b");
    let out = ops::assemble(
        &[3, 4],
        DType::F32,
        Device::Cpu,
        &[
            // a's last two columns, both rows, at the top left.
            Piece {
                src_col: 1,
                cols: 2,
                ..Piece::whole(&a, 0, 0)
            },
            // b's rows 1.. at rows 1..3, columns 2..4.
            Piece {
                src_row: 1,
                rows: 2,
                ..Piece::whole(&b, 1, 2)
            },
        ],
    )
    .expect("assemble");
    assert_eq!(
        out.to_vec_f32(),
        vec![2., 3., 0., 0., 5., 6., 9., 10., 0., 0., 11., 12.]
    );
    // Overlapping pieces and pieces out of bounds are refused.
    let overlap = ops::assemble(
        &[3, 4],
        DType::F32,
        Device::Cpu,
        &[Piece::whole(&a, 0, 0), Piece::whole(&b, 1, 2)],
    );
    assert!(overlap.is_err(), "overlap accepted");
    let outside = ops::assemble(&[2, 4], DType::F32, Device::Cpu, &[Piece::whole(&b, 0, 2)]);
    assert!(outside.is_err(), "out of bounds accepted");
    let wrong_dtype = ops::assemble(&[2, 3], DType::BF16, Device::Cpu, &[Piece::whole(&a, 0, 0)]);
    assert!(wrong_dtype.is_err(), "dtype mismatch accepted");
}
