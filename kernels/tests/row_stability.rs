//! Sequence parallelism splits a chunk's tokens over ranks, so every token-local op runs on a
//! shard's rows instead of the whole chunk's. Bit-identical results across card counts need each
//! output row of the CPU products to be independent of how many rows are computed with it.

use kernels::{ops, AttnMask, Tensor};

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn linear_rows_do_not_depend_on_the_row_count() {
    let full_rows = 70;
    let mut bad = Vec::new();
    for (k, n) in [
        (128, 128),
        (32, 32),
        (128, 32),
        (600, 32),
        (1536, 64),
        (256, 1536),
    ] {
        let x = values(1, full_rows * k);
        let w = Tensor::from_vec(values(2, n * k), &[n, k]).expect("w");
        let b = Tensor::from_vec(values(3, n), &[n]).expect("b");
        let whole = Tensor::from_vec(x.clone(), &[full_rows, k]).expect("x");
        let want = ops::linear(&whole, &w, Some(&b))
            .expect("linear")
            .to_vec_f32();
        for m in [1, 2, 3, 5, 8, 9, 17, 33, 64, 65] {
            for start in [0, full_rows - m] {
                let part = Tensor::from_vec(x[start * k..(start + m) * k].to_vec(), &[m, k])
                    .expect("part");
                let got = ops::linear(&part, &w, Some(&b))
                    .expect("linear")
                    .to_vec_f32();
                if bits(&got) != bits(&want[start * n..(start + m) * n]) {
                    bad.push(format!("k {k} n {n}: rows {start}..+{m}"));
                }
            }
        }
    }
    assert!(
        bad.is_empty(),
        "differ from the same rows of {full_rows}: {bad:?}"
    );
}

#[test]
fn attention_rows_do_not_depend_on_the_query_count() {
    let (heads, d) = (2, 32);
    let lq = 300;
    let mut bad = Vec::new();
    for kv in [1, 7, 32, 600] {
        let q = values(4, lq * heads * d);
        let k = Tensor::from_vec(values(5, kv * heads * d), &[kv, heads, d]).expect("k");
        let v = Tensor::from_vec(values(6, kv * heads * d), &[kv, heads, d]).expect("v");
        let all = Tensor::from_vec(q.clone(), &[lq, heads, d]).expect("q");
        let want = ops::attention(&all, &k, &v, kv, AttnMask::None)
            .expect("attention")
            .to_vec_f32();
        let row = heads * d;
        for m in [1, 2, 5, 8, 9, 64, 65, 257] {
            let start = lq - m;
            let part = Tensor::from_vec(q[start * row..].to_vec(), &[m, heads, d]).expect("q");
            let got = ops::attention(&part, &k, &v, kv, AttnMask::None)
                .expect("attention")
                .to_vec_f32();
            if bits(&got) != bits(&want[start * row..]) {
                bad.push(format!("kv {kv}: queries {start}..+{m}"));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "differ from the same queries of {lq}: {bad:?}"
    );
}
