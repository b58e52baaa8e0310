//! RoPE and attention against naive f64 references, plus their structural properties.

mod common;

use common::{
    assert_bf16_close, assert_bits_eq, assert_err_names, assert_f32_close, randn, tensor, widen,
    Rng,
};
use kernels::{ops, AttnMask, DType, Device, Result, RopeTable, Tensor};

const THETA: f64 = 10_000.0;

/// Wan's 3-D RoPE from its definition: pairs split time/height/width as `[c − 2⌊c/3⌋, ⌊c/3⌋,
/// ⌊c/3⌋]`, each axis with frequencies `θ^(−2j/d_axis)`, angles from absolute positions.
fn rope_ref(x: &[f32], heads: usize, d: usize, grid: [usize; 3], t_offset: usize) -> Vec<f64> {
    let c = d / 2;
    let pairs = [c - 2 * (c / 3), c / 3, c / 3];
    let mut out = widen(x);
    for n in 0..grid.iter().product() {
        let pos = [
            n / (grid[1] * grid[2]) + t_offset,
            n / grid[2] % grid[1],
            n % grid[2],
        ];
        let mut p = 0;
        for axis in 0..3 {
            for j in 0..pairs[axis] {
                let freq = THETA.powf(-((2 * j) as f64) / (2 * pairs[axis]) as f64);
                let (s, co) = (pos[axis] as f64 * freq).sin_cos();
                for h in 0..heads {
                    let i = (n * heads + h) * d + 2 * p;
                    let (a, b) = (x[i] as f64, x[i + 1] as f64);
                    out[i] = a * co - b * s;
                    out[i + 1] = a * s + b * co;
                }
                p += 1;
            }
        }
    }
    out
}

fn rope(dev: Device) -> Result<()> {
    let mut rng = Rng::new(20);
    // head_dim 20 splits 4/3/3 pairs; 128 is Wan's 22/21/21.
    for (d, heads, grid, t_offset) in [
        (20, 3, [3, 4, 5], 0),
        (20, 2, [2, 3, 2], 7),
        (128, 2, [2, 2, 3], 5),
    ] {
        let table = RopeTable::new(d, 16, THETA)?;
        let n: usize = grid.iter().product();
        let x = randn(dev, &mut rng, &[n, heads, d])?;
        let xv = x.to_vec_f32();
        let y = ops::rope_3d(&x, grid, t_offset, &table)?;
        assert_eq!(y.shape(), x.shape());
        assert_f32_close(
            &format!("rope_3d d{d} off{t_offset}"),
            &y,
            &rope_ref(&xv, heads, d, grid, t_offset),
        );
        // A rotation: every complex pair keeps its length.
        for (i, (a, b)) in xv.chunks(2).zip(y.to_vec_f32().chunks(2)).enumerate() {
            let na = (a[0] as f64).hypot(a[1] as f64);
            let nb = (b[0] as f64).hypot(b[1] as f64);
            assert!(
                (na - nb).abs() <= 1e-6 * na,
                "rope pair {i}: norm {na} -> {nb}"
            );
        }
        if t_offset == 0 {
            // Position (0, 0, 0) is the identity rotation.
            assert_bits_eq(
                "rope at origin",
                &y.to_vec_f32()[..heads * d],
                &xv[..heads * d],
            );
        }
    }
    assert_eq!(RopeTable::new(128, 4, THETA)?.pairs(), [22, 21, 21]);
    Ok(())
}
test_device!(rope, rope_cpu);

fn rope_time_offset(dev: Device) -> Result<()> {
    let mut rng = Rng::new(21);
    let (d, heads, [f, h, w], a) = (24, 2, [3, 2, 3], 4);
    let table = RopeTable::new(d, 16, THETA)?;
    let per_frame = h * w;
    // Frames a..a+f of a longer clip rotated from position 0 must equal those frames alone
    // rotated with t_offset = a: streaming chunks see the positions a full clip would.
    let full = randn(dev, &mut rng, &[(a + f) * per_frame, heads, d])?;
    let whole = ops::rope_3d(&full, [a + f, h, w], 0, &table)?;
    let chunk = full.narrow(0, a * per_frame, f * per_frame)?;
    let shifted = ops::rope_3d(&chunk, [f, h, w], a, &table)?;
    let tail = whole.narrow(0, a * per_frame, f * per_frame)?;
    assert_bits_eq("rope t_offset", &shifted.to_vec_f32(), &tail.to_vec_f32());

    // bf16 in, bf16 out, against the reference on the rounded inputs.
    let cb = chunk.to_dtype(DType::BF16)?;
    let want = rope_ref(&cb.to_vec_f32(), heads, d, [f, h, w], a);
    assert_bf16_close(
        "rope bf16",
        &ops::rope_3d(&cb, [f, h, w], a, &table)?,
        &want,
    );

    assert_err_names(ops::rope_3d(&chunk, [f, h, w], 14, &table), "rope_3d");
    assert_err_names(ops::rope_3d(&chunk, [f, h, w + 1], 0, &table), "rope_3d");
    let other = RopeTable::new(d + 2, 16, THETA)?;
    assert_err_names(ops::rope_3d(&chunk, [f, h, w], 0, &other), "rope_3d");
    Ok(())
}
test_device!(rope_time_offset, rope_time_offset_cpu);

/// Softmax attention per head in f64; query `i` sees keys `[0, limit(i))`.
fn attention_ref(q: &Tensor, k: &Tensor, v: &Tensor, limit: impl Fn(usize) -> usize) -> Vec<f64> {
    let scale = 1.0 / (q.dim(2) as f64).sqrt();
    attention_ref_with(q, k, v, limit, scale, |_, _, _| 0.0)
}

/// As [`attention_ref`] with logits `scale · q·k + bias(head, query, key)`.
fn attention_ref_with(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    limit: impl Fn(usize) -> usize,
    scale: f64,
    bias: impl Fn(usize, usize, usize) -> f64,
) -> Vec<f64> {
    let (lq, heads, d) = (q.dim(0), q.dim(1), q.dim(2));
    let (qv, kv, vv) = (
        widen(&q.to_vec_f32()),
        widen(&k.to_vec_f32()),
        widen(&v.to_vec_f32()),
    );
    let at = |r: usize, h: usize| (r * heads + h) * d;
    let mut out = vec![0.0; lq * heads * d];
    for i in 0..lq {
        for h in 0..heads {
            let s: Vec<f64> = (0..limit(i))
                .map(|j| {
                    (0..d)
                        .map(|c| qv[at(i, h) + c] * kv[at(j, h) + c])
                        .sum::<f64>()
                        * scale
                        + bias(h, i, j)
                })
                .collect();
            let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (j, p) in e.iter().enumerate() {
                for c in 0..d {
                    out[at(i, h) + c] += p / sum * vv[at(j, h) + c];
                }
            }
        }
    }
    out
}

fn scaled(dev: Device, t: &Tensor, by: f32) -> Result<Tensor> {
    let v = t.to_vec_f32().iter().map(|x| x * by).collect();
    tensor(dev, v, t.shape())
}

fn attention_unmasked(dev: Device) -> Result<()> {
    let mut rng = Rng::new(22);
    let (lq, lk, heads, d) = (7, 13, 3, 16);
    let q = randn(dev, &mut rng, &[lq, heads, d])?;
    let k = randn(dev, &mut rng, &[lk, heads, d])?;
    let v = randn(dev, &mut rng, &[lk, heads, d])?;
    let y = ops::attention(&q, &k, &v, lk, AttnMask::None)?;
    assert_eq!(y.shape(), q.shape());
    assert_f32_close("attention", &y, &attention_ref(&q, &k, &v, |_| lk));
    // Scores in the hundreds overflow exp unless the row max is subtracted first.
    let qs = scaled(dev, &q, 40.0)?;
    let y = ops::attention(&qs, &k, &v, lk, AttnMask::None)?;
    assert_f32_close(
        "attention, large scores",
        &y,
        &attention_ref(&qs, &k, &v, |_| lk),
    );

    let (qb, kb, vb) = (
        q.to_dtype(DType::BF16)?,
        k.to_dtype(DType::BF16)?,
        v.to_dtype(DType::BF16)?,
    );
    let y = ops::attention(&qb, &kb, &vb, lk, AttnMask::None)?;
    assert_bf16_close("attention bf16", &y, &attention_ref(&qb, &kb, &vb, |_| lk));
    Ok(())
}
test_device!(attention_unmasked, attention_unmasked_cpu);

/// A KV cache's storage is longer than what it holds: rows past `kv_len` must not be read. They
/// are NaN here, so reading any of them poisons the output.
fn attention_kv_len(dev: Device) -> Result<()> {
    let mut rng = Rng::new(23);
    let (lq, cap, kv_len, heads, d) = (5, 20, 11, 2, 8);
    let q = randn(dev, &mut rng, &[lq, heads, d])?;
    let poison = |rng: &mut Rng| -> Result<Tensor> {
        let mut data = rng.normals(cap * heads * d, 1.0);
        data[kv_len * heads * d..].fill(f32::NAN);
        tensor(dev, data, &[cap, heads, d])
    };
    let (k, v) = (poison(&mut rng)?, poison(&mut rng)?);
    let y = ops::attention(&q, &k, &v, kv_len, AttnMask::None)?;
    assert_f32_close(
        "attention kv_len",
        &y,
        &attention_ref(&q, &k, &v, |_| kv_len),
    );

    // A single visible key takes all the weight: every row is exactly that key's value.
    let y = ops::attention(&q, &k, &v, 1, AttnMask::None)?.to_vec_f32();
    let v0 = &v.to_vec_f32()[..heads * d];
    for (i, row) in y.chunks(heads * d).enumerate() {
        assert_bits_eq(&format!("attention kv_len 1, query {i}"), row, v0);
    }
    Ok(())
}
test_device!(attention_kv_len, attention_kv_len_cpu);

fn attention_block_causal(dev: Device) -> Result<()> {
    let mut rng = Rng::new(24);
    // 10 tokens in blocks of 4 leave a partial last block; 300 spans two query blocks of the
    // CPU kernel.
    for (l, bt, heads, d) in [(10, 4, 2, 8), (300, 100, 2, 8), (6, 1, 3, 4)] {
        let q = randn(dev, &mut rng, &[l, heads, d])?;
        let k = randn(dev, &mut rng, &[l, heads, d])?;
        let v = randn(dev, &mut rng, &[l, heads, d])?;
        let mask = AttnMask::BlockCausal { block_tokens: bt };
        let y = ops::attention(&q, &k, &v, l, mask)?;
        let want = attention_ref(&q, &k, &v, |i| ((i / bt + 1) * bt).min(l));
        assert_f32_close(&format!("block causal L{l} block {bt}"), &y, &want);
        if bt == 1 {
            // The first query of a causal mask sees only the first key.
            let (yv, vv) = (y.to_vec_f32(), v.to_vec_f32());
            assert_bits_eq("causal first row", &yv[..heads * d], &vv[..heads * d]);
        }
    }
    // One block spanning everything is no mask at all.
    let (l, heads, d) = (9, 2, 8);
    let q = randn(dev, &mut rng, &[l, heads, d])?;
    let k = randn(dev, &mut rng, &[l, heads, d])?;
    let v = randn(dev, &mut rng, &[l, heads, d])?;
    let a = ops::attention(&q, &k, &v, l, AttnMask::BlockCausal { block_tokens: l })?;
    let b = ops::attention(&q, &k, &v, l, AttnMask::None)?;
    assert_bits_eq("one block", &a.to_vec_f32(), &b.to_vec_f32());
    Ok(())
}
test_device!(attention_block_causal, attention_block_causal_cpu);

fn attention_errors(dev: Device) -> Result<()> {
    let mut rng = Rng::new(25);
    let q = randn(dev, &mut rng, &[4, 2, 8])?;
    let k = randn(dev, &mut rng, &[6, 2, 8])?;
    let v = randn(dev, &mut rng, &[6, 2, 8])?;
    let k3 = randn(dev, &mut rng, &[6, 3, 8])?;
    assert_err_names(ops::attention(&q, &k3, &k3, 6, AttnMask::None), "attention");
    assert_err_names(ops::attention(&q, &k, &k3, 6, AttnMask::None), "attention");
    assert_err_names(ops::attention(&q, &k, &v, 0, AttnMask::None), "attention");
    assert_err_names(ops::attention(&q, &k, &v, 7, AttnMask::None), "attention");
    let causal = AttnMask::BlockCausal { block_tokens: 2 };
    assert_err_names(ops::attention(&q, &k, &v, 6, causal), "attention");
    let zero = AttnMask::BlockCausal { block_tokens: 0 };
    assert_err_names(ops::attention(&q, &k, &v, 4, zero), "attention");
    Ok(())
}
test_device!(attention_errors, attention_errors_cpu);

/// T5's attention: logits `scale · q·k + table[h, span − 1 + j − i]`, keys past `kv_len` unread
/// (NaN here), a table wider than the offsets need.
fn attention_offset_bias(dev: Device) -> Result<()> {
    let mut rng = Rng::new(26);
    let (lq, cap, kv_len, heads, d, span) = (6, 9, 7, 2, 8, 10);
    let q = randn(dev, &mut rng, &[lq, heads, d])?;
    let poison = |rng: &mut Rng| -> Result<Tensor> {
        let mut data = rng.normals(cap * heads * d, 1.0);
        data[kv_len * heads * d..].fill(f32::NAN);
        tensor(dev, data, &[cap, heads, d])
    };
    let (k, v) = (poison(&mut rng)?, poison(&mut rng)?);
    let table_v = rng.normals(heads * (2 * span - 1), 2.0);
    let table = tensor(dev, table_v.clone(), &[heads, 2 * span - 1])?;
    let bias = |h: usize, i: usize, j: usize| table_v[h * (2 * span - 1) + span - 1 + j - i] as f64;
    for scale in [1.0f32, 0.3] {
        let y = ops::attention_offset_bias(&q, &k, &v, kv_len, &table, scale)?;
        assert_eq!(y.shape(), q.shape());
        let want = attention_ref_with(&q, &k, &v, |_| kv_len, scale as f64, bias);
        assert_f32_close(&format!("offset bias, scale {scale}"), &y, &want);
    }
    // A bias far above every logit at offset +2 makes each query (whose key i + 2 is visible)
    // copy that key's value exactly: the offset is read with its sign.
    let mut peaked = vec![0f32; heads * (2 * span - 1)];
    for h in 0..heads {
        peaked[h * (2 * span - 1) + span - 1 + 2] = 1e4;
    }
    let peaked = tensor(dev, peaked, &[heads, 2 * span - 1])?;
    let y = ops::attention_offset_bias(&q, &k, &v, kv_len, &peaked, 1.0)?.to_vec_f32();
    let vv = v.to_vec_f32();
    let row = heads * d;
    for i in 0..kv_len - 2 {
        let want = &vv[(i + 2) * row..(i + 3) * row];
        assert_bits_eq(
            &format!("peaked offset, query {i}"),
            &y[i * row..(i + 1) * row],
            want,
        );
    }
    let bf = q.to_dtype(DType::BF16)?;
    let (kb, vb) = (k.to_dtype(DType::BF16)?, v.to_dtype(DType::BF16)?);
    let y = ops::attention_offset_bias(&bf, &kb, &vb, kv_len, &table, 1.0)?;
    let want = attention_ref_with(&bf, &kb, &vb, |_| kv_len, 1.0, bias);
    assert_bf16_close("offset bias bf16", &y, &want);
    // Errors: a table too narrow for the offsets, of even width, in bf16, or for other heads.
    let name = "attention_offset_bias";
    let narrow = tensor(dev, vec![0.5; heads * 11], &[heads, 11])?;
    assert_err_names(
        ops::attention_offset_bias(&q, &k, &v, kv_len, &narrow, 1.0),
        name,
    );
    let even = tensor(dev, vec![0.5; heads * 20], &[heads, 20])?;
    assert_err_names(
        ops::attention_offset_bias(&q, &k, &v, kv_len, &even, 1.0),
        name,
    );
    let t16 = table.to_dtype(DType::BF16)?;
    assert_err_names(
        ops::attention_offset_bias(&q, &k, &v, kv_len, &t16, 1.0),
        name,
    );
    let heads3 = tensor(dev, vec![0.5; 3 * 19], &[3, 19])?;
    assert_err_names(
        ops::attention_offset_bias(&q, &k, &v, kv_len, &heads3, 1.0),
        name,
    );
    assert_err_names(
        ops::attention_offset_bias(&q, &k, &v, cap + 1, &table, 1.0),
        name,
    );
    Ok(())
}
test_device!(attention_offset_bias, attention_offset_bias_cpu);
