//! VSA (video sparse attention) on the CPU against a naive f64 implementation written from the
//! definition (grid coordinates, tile membership by division, full score matrices, sorting), plus
//! the tiling's invariants and the dense limit.

mod common;

use common::{rel_l2, Rng};
use kernels::vsa::{self, Coarse, Tiling, TILE};
use kernels::{ops, AttnMask, Tensor};

fn coords(g: usize, grid: [usize; 3]) -> [usize; 3] {
    [
        g / (grid[1] * grid[2]),
        (g / grid[2]) % grid[1],
        g % grid[2],
    ]
}

/// Tile number of grid index `g` in t → h → w tile order.
fn tile_of(g: usize, grid: [usize; 3]) -> usize {
    let c = coords(g, grid);
    let n: [usize; 3] = std::array::from_fn(|a| grid[a].div_ceil(TILE[a]));
    ((c[0] / TILE[0]) * n[1] + c[1] / TILE[1]) * n[2] + c[2] / TILE[2]
}

#[test]
fn tiling_is_a_permutation_of_contiguous_partial_tiles() {
    for grid in [[3, 30, 52], [18, 30, 52], [5, 6, 9], [1, 1, 1], [4, 4, 4]] {
        let t = Tiling::new(grid, TILE);
        let n: usize = grid.iter().product();
        let mut seen = vec![false; n];
        for &g in &t.order {
            assert!(
                !std::mem::replace(&mut seen[g], true),
                "{grid:?}: {g} twice"
            );
        }
        assert!(seen.iter().all(|&s| s), "{grid:?}: a token is missing");
        let nt: [usize; 3] = std::array::from_fn(|a| grid[a].div_ceil(4));
        assert_eq!(
            t.tiles(),
            nt.iter().product::<usize>(),
            "{grid:?}: tile count"
        );
        assert_eq!(vsa::tiles(grid, TILE), t.tiles(), "{grid:?}: tiles()");
        for j in 0..t.tiles() {
            let tokens = &t.order[t.offsets[j]..t.offsets[j] + t.sizes[j]];
            assert!(
                tokens.iter().all(|&g| tile_of(g, grid) == j),
                "{grid:?}: tile {j} mixed"
            );
            // Size from the tile's extent on each axis (partial only at the far edges).
            let (bt, bh, bw) = (j / (nt[1] * nt[2]), (j / nt[2]) % nt[1], j % nt[2]);
            let ext = |a: usize, b: usize| 4.min(grid[a] - 4 * b);
            assert_eq!(
                t.sizes[j],
                ext(0, bt) * ext(1, bh) * ext(2, bw),
                "{grid:?}: tile {j} size"
            );
        }
        let inv = t.inverse();
        assert!((0..n).all(|g| t.order[inv[g]] == g), "{grid:?}: inverse");
    }
    // The chunk of 3 latent frames of 30×52 tokens: 1 × 8 × 13 tiles, the last row and column
    // partial (30 = 7·4 + 2, 52 = 13·4).
    let t = Tiling::new([3, 30, 52], TILE);
    assert_eq!(t.tiles(), 104);
    assert_eq!(t.sizes[0], 48);
    assert_eq!(t.sizes[103], 3 * 2 * 4);
}

#[test]
fn top_k_follows_the_sparsity_rule() {
    assert_eq!(vsa::top_k(0.9, 624), 63);
    assert_eq!(vsa::top_k(0.0, 10), 10);
    assert_eq!(vsa::top_k(1.0, 10), 1);
    assert_eq!(vsa::top_k(0.5, 3), 2);
}

struct Case {
    q_grid: [usize; 3],
    k_grid: [usize; 3],
    heads: usize,
    d: usize,
}

/// The definition, naively in f64: tile means from tile membership, coarse softmax, top-k by
/// sorting the coarse scores (ties to the lower tile), fine softmax over the kept tiles' keys.
fn naive(
    c: &Case,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    gate: Option<&[f32]>,
    top_k: usize,
) -> Vec<f64> {
    let (lq, lk): (usize, usize) = (c.q_grid.iter().product(), c.k_grid.iter().product());
    let (h_n, d) = (c.heads, c.d);
    let nq = Tiling::new(c.q_grid, TILE).tiles();
    let nk = Tiling::new(c.k_grid, TILE).tiles();
    let at = |x: &[f32], i: usize, h: usize, e: usize| x[(i * h_n + h) * d + e] as f64;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0f64; lq * h_n * d];
    for h in 0..h_n {
        let means = |x: &[f32], len: usize, grid: [usize; 3], tiles: usize| {
            let mut m = vec![vec![0f64; d]; tiles];
            let mut cnt = vec![0usize; tiles];
            for i in 0..len {
                let j = tile_of(i, grid);
                cnt[j] += 1;
                for (e, acc) in m[j].iter_mut().enumerate() {
                    *acc += at(x, i, h, e);
                }
            }
            for (row, n) in m.iter_mut().zip(&cnt) {
                row.iter_mut().for_each(|x| *x /= *n as f64);
            }
            m
        };
        let (qm, km, vm) = (
            means(q, lq, c.q_grid, nq),
            means(k, lk, c.k_grid, nk),
            means(v, lk, c.k_grid, nk),
        );
        for i in 0..lq {
            let ti = tile_of(i, c.q_grid);
            let s: Vec<f64> = (0..nk)
                .map(|j| (0..d).map(|e| qm[ti][e] * km[j][e]).sum::<f64>() * scale)
                .collect();
            let mx = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().map(|x| (x - mx).exp()).sum();
            let mut order: Vec<usize> = (0..nk).collect();
            order.sort_by(|&a, &b| s[b].partial_cmp(&s[a]).expect("finite").then(a.cmp(&b)));
            let kept = &order[..top_k];
            let keys: Vec<usize> = (0..lk)
                .filter(|&j| kept.contains(&tile_of(j, c.k_grid)))
                .collect();
            let f: Vec<f64> = keys
                .iter()
                .map(|&j| (0..d).map(|e| at(q, i, h, e) * at(k, j, h, e)).sum::<f64>() * scale)
                .collect();
            let fm = f.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let fz: f64 = f.iter().map(|x| (x - fm).exp()).sum();
            for e in 0..d {
                let coarse: f64 = (0..nk).map(|j| (s[j] - mx).exp() / z * vm[j][e]).sum();
                let fine: f64 = keys
                    .iter()
                    .zip(&f)
                    .map(|(&j, &fj)| (fj - fm).exp() / fz * at(v, j, h, e))
                    .sum();
                let g = gate.map_or(1.0, |g| at(g, i, h, e));
                out[(i * h_n + h) * d + e] = fine + g * coarse;
            }
        }
    }
    out
}

fn inputs(rng: &mut Rng, c: &Case) -> [Tensor; 4] {
    let (lq, lk): (usize, usize) = (c.q_grid.iter().product(), c.k_grid.iter().product());
    let mk = |rng: &mut Rng, n: usize| {
        Tensor::from_vec(rng.normals(n * c.heads * c.d, 1.0), &[n, c.heads, c.d]).expect("tensor")
    };
    [mk(rng, lq), mk(rng, lk), mk(rng, lk), mk(rng, lq)]
}

#[test]
fn matches_the_definition_at_several_sparsities() {
    let mut rng = Rng::new(31);
    // A chunk of 3 frames over a cache of 9 (2 time tiles, partial spatial tiles), and a grid
    // of one partial tile per axis.
    for c in [
        Case {
            q_grid: [3, 6, 9],
            k_grid: [9, 6, 9],
            heads: 2,
            d: 16,
        },
        Case {
            q_grid: [2, 3, 5],
            k_grid: [6, 3, 5],
            heads: 1,
            d: 8,
        },
    ] {
        let [q, k, v, gate] = inputs(&mut rng, &c);
        let nk = Tiling::new(c.k_grid, TILE).tiles();
        for sparsity in [0.0, 0.5, 0.75, 0.9] {
            let top_k = vsa::top_k(sparsity, nk);
            for g in [None, Some(&gate)] {
                let got = vsa::attention(&q, &k, &v, g, c.q_grid, c.k_grid, top_k).expect("vsa");
                let want = naive(
                    &c,
                    &q.to_vec_f32(),
                    &k.to_vec_f32(),
                    &v.to_vec_f32(),
                    g.map(|g| g.to_vec_f32()).as_deref(),
                    top_k,
                );
                let e = rel_l2(&got.to_vec_f32(), &want);
                assert!(
                    e < 1e-5,
                    "{:?} sparsity {sparsity} gated {}: rel L2 {e:e}",
                    c.q_grid,
                    g.is_some()
                );
            }
            // Select-only: the fine branch alone, the definition's sum with a zero gate.
            let got =
                vsa::attention_with(&q, &k, &v, Coarse::SelectOnly, c.q_grid, c.k_grid, top_k)
                    .expect("vsa");
            let zeros = vec![0.0; q.elem_count()];
            let want = naive(
                &c,
                &q.to_vec_f32(),
                &k.to_vec_f32(),
                &v.to_vec_f32(),
                Some(&zeros),
                top_k,
            );
            let e = rel_l2(&got.to_vec_f32(), &want);
            assert!(
                e < 1e-5,
                "{:?} sparsity {sparsity} select-only: rel L2 {e:e}",
                c.q_grid
            );
        }
    }
}

#[test]
fn keys_past_the_grid_are_never_read() {
    // A KV cache's buffers hold more rows than its frames fill: rows past `k_grid` must change
    // nothing, even as NaN.
    let mut rng = Rng::new(34);
    let c = Case {
        q_grid: [3, 6, 9],
        k_grid: [7, 6, 9],
        heads: 2,
        d: 16,
    };
    let [q, k, v, gate] = inputs(&mut rng, &c);
    let pad = |t: &Tensor| {
        let mut x = t.to_vec_f32();
        x.extend(std::iter::repeat_n(f32::NAN, 5 * 54 * c.heads * c.d));
        Tensor::from_vec(x, &[t.dim(0) + 5 * 54, c.heads, c.d]).expect("padded")
    };
    let (kp, vp) = (pad(&k), pad(&v));
    let top_k = vsa::top_k(0.5, vsa::tiles(c.k_grid, TILE));
    for coarse in [Coarse::Added, Coarse::Gated(&gate), Coarse::SelectOnly] {
        let want = vsa::attention_with(&q, &k, &v, coarse, c.q_grid, c.k_grid, top_k).expect("vsa");
        let got =
            vsa::attention_with(&q, &kp, &vp, coarse, c.q_grid, c.k_grid, top_k).expect("padded");
        assert_eq!(
            got.to_vec_f32(),
            want.to_vec_f32(),
            "{coarse:?}: rows past the grid changed the result"
        );
    }
}

#[test]
fn every_tile_kept_and_no_coarse_branch_is_dense_attention() {
    let mut rng = Rng::new(32);
    let c = Case {
        q_grid: [3, 8, 10],
        k_grid: [12, 8, 10],
        heads: 3,
        d: 32,
    };
    let [q, k, v, _] = inputs(&mut rng, &c);
    let zero = Tensor::zeros(q.shape(), q.dtype()).expect("zeros");
    let all = Tiling::new(c.k_grid, TILE).tiles();
    let dense = ops::attention(&q, &k, &v, k.dim(0), AttnMask::None).expect("dense");
    let got = vsa::attention(&q, &k, &v, Some(&zero), c.q_grid, c.k_grid, all).expect("vsa");
    let e = rel_l2(&got.to_vec_f32(), &common::widen(&dense.to_vec_f32()));
    assert!(e < 1e-5, "rel L2 {e:e}");
    let only = Coarse::SelectOnly;
    let got = vsa::attention_with(&q, &k, &v, only, c.q_grid, c.k_grid, all).expect("vsa");
    let e = rel_l2(&got.to_vec_f32(), &common::widen(&dense.to_vec_f32()));
    assert!(e < 1e-5, "select-only: rel L2 {e:e}");
    // And sparsity changes the answer: the test above is not passing by accident.
    let sparse = vsa::attention(&q, &k, &v, Some(&zero), c.q_grid, c.k_grid, 1).expect("sparse");
    let e = rel_l2(&sparse.to_vec_f32(), &common::widen(&dense.to_vec_f32()));
    assert!(
        e > 1e-2,
        "one kept tile should differ from dense: rel L2 {e:e}"
    );
}

#[test]
fn refuses_bad_shapes_and_top_k() {
    let mut rng = Rng::new(33);
    let c = Case {
        q_grid: [1, 4, 4],
        k_grid: [2, 4, 4],
        heads: 1,
        d: 8,
    };
    let [q, k, v, _] = inputs(&mut rng, &c);
    let msg = |r: kernels::Result<Tensor>| r.expect_err("should fail").to_string();
    assert!(msg(vsa::attention(&q, &k, &v, None, [1, 4, 5], c.k_grid, 1)).contains("vsa"));
    assert!(msg(vsa::attention(&q, &k, &v, None, c.q_grid, c.k_grid, 0)).contains("top_k"));
    assert!(msg(vsa::attention(&q, &k, &v, None, c.q_grid, c.k_grid, 2)).contains("top_k"));
    assert!(msg(vsa::attention(&q, &k, &q, None, c.q_grid, c.k_grid, 1)).contains("vsa"));
}

#[test]
fn the_device_check_on_the_cpu_is_exact() {
    // The CPU against itself: the check's own arithmetic, on the inputs it gives a device.
    assert_eq!(vsa::check(kernels::Device::Cpu).expect("check"), 0.0);
}

#[test]
fn frame_sums_add_each_frames_slabs() {
    // Naive: every token added to the slab its coordinates fall in, in f64.
    let mut rng = Rng::new(35);
    let (grid, heads, d, first) = ([3, 6, 9], 2, 8, 54);
    let n = first + grid.iter().product::<usize>();
    let x = Tensor::from_vec(rng.normals(n * heads * d, 1.0), &[n, heads, d]).expect("x");
    let got = vsa::frame_sums(&x, first, grid).expect("sums");
    let (nh, nw) = (grid[1].div_ceil(4), grid[2].div_ceil(4));
    assert_eq!(got.shape(), &[grid[0] * nh * nw, heads, d]);
    assert_eq!(vsa::slabs_per_frame([grid[1], grid[2]]), nh * nw);
    let xs = x.to_vec_f32();
    let mut want = vec![0f64; got.elem_count()];
    for g in 0..grid.iter().product::<usize>() {
        let [t, y, w] = coords(g, grid);
        let slab = (t * nh + y / 4) * nw + w / 4;
        for c in 0..heads * d {
            want[slab * heads * d + c] += xs[(first + g) * heads * d + c] as f64;
        }
    }
    let e = rel_l2(&got.to_vec_f32(), &want);
    assert!(e < 1e-6, "rel L2 {e:e}");
    let msg = vsa::frame_sums(&x, first + 1, grid)
        .expect_err("past the end")
        .to_string();
    assert!(msg.contains("frame sums"), "{msg}");
}

#[test]
fn frame_sums_into_write_only_their_rows() {
    let mut rng = Rng::new(36);
    let (grid, heads, d, first) = ([2, 6, 9], 2, 8, 54);
    let n = first + grid.iter().product::<usize>();
    let x = Tensor::from_vec(rng.normals(n * heads * d, 1.0), &[n, heads, d]).expect("x");
    let fresh = vsa::frame_sums(&x, first, grid).expect("sums").to_vec_f32();
    let (row, rows) = (3, 5 * vsa::slabs_per_frame([grid[1], grid[2]]));
    let before = rng.normals(rows * heads * d, 1.0);
    let mut sums = Tensor::from_vec(before.clone(), &[rows, heads, d]).expect("sums");
    vsa::frame_sums_into(&mut sums, row, &x, first, grid).expect("into");
    let got = sums.to_vec_f32();
    let (at, len) = (row * heads * d, fresh.len());
    assert_eq!(&got[at..at + len], &fresh[..], "the written rows");
    assert_eq!(&got[..at], &before[..at], "rows before");
    assert_eq!(&got[at + len..], &before[at + len..], "rows after");
    // Past the end of the sums, and sums not in f32: errors that say so, nothing written.
    let past = rows - fresh.len() / (heads * d) + 1;
    let msg = vsa::frame_sums_into(&mut sums, past, &x, first, grid)
        .expect_err("past the end")
        .to_string();
    assert!(msg.contains("frame sums into"), "{msg}");
    assert_eq!(sums.to_vec_f32(), got);
    let mut bf = sums.to_dtype(kernels::DType::BF16).expect("bf16");
    let msg = vsa::frame_sums_into(&mut bf, row, &x, first, grid)
        .expect_err("bf16 sums")
        .to_string();
    assert!(msg.contains("f32"), "{msg}");
}

#[test]
fn means_from_frame_sums_give_the_same_attention() {
    // A cache's sums (frames written in two parts, as chunks arrive) in place of the means of
    // its rows: the same result up to the order of the f32 additions.
    let mut rng = Rng::new(36);
    let c = Case {
        q_grid: [3, 6, 9],
        k_grid: [9, 6, 9],
        heads: 2,
        d: 16,
    };
    let [q, k, v, gate] = inputs(&mut rng, &c);
    let sums = |x: &Tensor| {
        let (a, b) = (
            vsa::frame_sums(x, 0, [5, 6, 9]).expect("first frames"),
            vsa::frame_sums(x, 5 * 54, [4, 6, 9]).expect("last frames"),
        );
        let mut all = a.to_vec_f32();
        all.extend(b.to_vec_f32());
        Tensor::from_vec(all, &[9 * 6, c.heads, c.d]).expect("sums")
    };
    let (ks, vs) = (sums(&k), sums(&v));
    assert_eq!(
        ks.to_vec_f32(),
        vsa::frame_sums(&k, 0, c.k_grid)
            .expect("whole")
            .to_vec_f32(),
        "frames summed apart differ from frames summed at once"
    );
    let nk = vsa::tiles(c.k_grid, TILE);
    for sparsity in [0.0, 0.5, 0.9] {
        let top_k = vsa::top_k(sparsity, nk);
        for coarse in [Coarse::Added, Coarse::Gated(&gate), Coarse::SelectOnly] {
            let want =
                vsa::attention_with(&q, &k, &v, coarse, c.q_grid, c.k_grid, top_k).expect("vsa");
            let with = vsa::KeySums {
                k: &ks,
                v: Some(&vs),
                q: None,
            };
            let got = vsa::attention_cached(&q, &k, &v, with, coarse, c.q_grid, c.k_grid, top_k)
                .expect("cached");
            let e = rel_l2(&got.to_vec_f32(), &common::widen(&want.to_vec_f32()));
            assert!(e < 1e-5, "{coarse:?} sparsity {sparsity}: rel L2 {e:e}");
            // The queries' means from their slab sums too (as their norm + RoPE leaves them).
            let qs = vsa::frame_sums(&q, 0, c.q_grid).expect("query sums");
            let with_q = vsa::KeySums {
                q: Some(&qs),
                ..with
            };
            let got = vsa::attention_cached(&q, &k, &v, with_q, coarse, c.q_grid, c.k_grid, top_k)
                .expect("cached, query sums");
            let e = rel_l2(&got.to_vec_f32(), &common::widen(&want.to_vec_f32()));
            assert!(
                e < 1e-5,
                "{coarse:?} sparsity {sparsity}, query sums: rel L2 {e:e}"
            );
        }
    }
    // Query sums of the wrong grid are refused, not read past.
    let top_k = vsa::top_k(0.5, nk);
    let qs_short = vsa::frame_sums(&q, 0, [2, 6, 9]).expect("2 frames");
    let bad = vsa::KeySums {
        k: &ks,
        v: None,
        q: Some(&qs_short),
    };
    let msg = vsa::attention_cached(
        &q,
        &k,
        &v,
        bad,
        Coarse::SelectOnly,
        c.q_grid,
        c.k_grid,
        top_k,
    )
    .expect_err("query sums of 2 frames")
    .to_string();
    assert!(msg.contains("query sums"), "{msg}");
    // Select-only reads no value sums; the coarse output needs them.
    let top_k = vsa::top_k(0.5, nk);
    let keys_only = vsa::KeySums {
        k: &ks,
        v: None,
        q: None,
    };
    let only = Coarse::SelectOnly;
    vsa::attention_cached(&q, &k, &v, keys_only, only, c.q_grid, c.k_grid, top_k)
        .expect("select-only without value sums");
    let msg = vsa::attention_cached(
        &q,
        &k,
        &v,
        keys_only,
        Coarse::Added,
        c.q_grid,
        c.k_grid,
        top_k,
    )
    .expect_err("needs the values' sums")
    .to_string();
    assert!(msg.contains("values' too"), "{msg}");
    // Sums of fewer frames than the key grid are refused.
    let short = vsa::frame_sums(&k, 0, [8, 6, 9]).expect("8 frames");
    let few = vsa::KeySums {
        k: &short,
        v: None,
        q: None,
    };
    let msg = vsa::attention_cached(&q, &k, &v, few, only, c.q_grid, c.k_grid, top_k)
        .expect_err("too few frames")
        .to_string();
    assert!(msg.contains("sums"), "{msg}");
}
