//! `KvCache` against a model that keeps one vector per frame and evicts by list removal.

mod common;

use common::{assert_bits_eq, randn, tensor, Rng};
use kernels::{ops, AttnMask, DType, Device, KvCache, Result, RopeTable, Tensor};

/// The cache's contract without the row arithmetic: held frames with their K/V rows, oldest
/// first; the first `sink` frames ever written stay, the oldest others go when full.
struct Model {
    window: usize,
    sink: usize,
    frames: Vec<(u64, Vec<f32>, Vec<f32>)>,
}

impl Model {
    /// Applies a write of `k`/`v` (split per frame) at `first`; false where the cache must refuse.
    fn write(&mut self, first: u64, k: &[Vec<f32>], v: &[Vec<f32>]) -> bool {
        let n = k.len();
        if let Some(pos) = self.frames.iter().position(|f| f.0 == first) {
            let held = &mut self.frames[pos..];
            let whole = held.len() >= n && (0..n).all(|i| held[i].0 == first + i as u64);
            if !whole {
                return false;
            }
            for (i, f) in held.iter_mut().take(n).enumerate() {
                f.1.clone_from(&k[i]);
                f.2.clone_from(&v[i]);
            }
            return true;
        }
        if self.frames.last().is_some_and(|f| f.0 >= first) {
            return false;
        }
        let old = self.frames.len();
        if old + n > self.window && old + n - self.window > old - self.sink.min(old) {
            return false;
        }
        for i in 0..n {
            self.frames
                .push((first + i as u64, k[i].clone(), v[i].clone()));
        }
        while self.frames.len() > self.window {
            self.frames.remove(self.sink);
        }
        true
    }

    fn ids(&self) -> Vec<u64> {
        self.frames.iter().map(|f| f.0).collect()
    }
}

/// A chunk as the cache takes it (`k`, `v`) and as the model keeps it (one vector per frame).
type Chunk = (Tensor, Tensor, Vec<Vec<f32>>, Vec<Vec<f32>>);

struct Setup {
    window: usize,
    sink: usize,
    tpf: usize,
    heads: usize,
    hd: usize,
}

impl Setup {
    fn frame_len(&self) -> usize {
        self.tpf * self.heads * self.hd
    }

    /// A random chunk of `n` frames.
    fn chunk(&self, dev: Device, rng: &mut Rng, n: usize) -> Result<Chunk> {
        let shape = [n * self.tpf, self.heads, self.hd];
        let (k, v) = (randn(dev, rng, &shape)?, randn(dev, rng, &shape)?);
        let split = |t: &Tensor| {
            t.to_vec_f32()
                .chunks(self.frame_len())
                .map(<[f32]>::to_vec)
                .collect()
        };
        let (ks, vs) = (split(&k), split(&v));
        Ok((k, v, ks, vs))
    }
}

#[track_caller]
fn assert_matches(s: &Setup, cache: &KvCache, model: &Model, what: &str) -> Result<()> {
    assert_eq!(cache.frames(), &model.ids()[..], "{what}: frames");
    assert_eq!(
        cache.len_tokens(),
        model.frames.len() * s.tpf,
        "{what}: len_tokens"
    );
    assert_eq!(
        cache.keys().shape(),
        &[s.window * s.tpf, s.heads, s.hd],
        "{what}: storage"
    );
    let held = cache.len_tokens();
    let k: Vec<f32> = model.frames.iter().flat_map(|f| f.1.clone()).collect();
    let v: Vec<f32> = model.frames.iter().flat_map(|f| f.2.clone()).collect();
    assert_bits_eq(
        &format!("{what}: keys"),
        &cache.keys().narrow(0, 0, held)?.to_vec_f32(),
        &k,
    );
    assert_bits_eq(
        &format!("{what}: values"),
        &cache.values().narrow(0, 0, held)?.to_vec_f32(),
        &v,
    );
    Ok(())
}

fn kv_cache_scripted(dev: Device) -> Result<()> {
    dev.ensure_available()?;
    let s = Setup {
        window: 5,
        sink: 1,
        tpf: 2,
        heads: 2,
        hd: 4,
    };
    let mut rng = Rng::new(40);
    let mut cache = KvCache::new(s.window, s.sink, s.tpf, s.heads, s.hd, DType::F32)?;
    let mut model = Model {
        window: s.window,
        sink: s.sink,
        frames: Vec::new(),
    };
    // (first frame, frames, accepted): appends, a denoising-step rewrite in place, eviction past
    // the sink, a rewrite of a suffix and of one frame, then the refusals.
    let script: [(u64, usize, bool); 12] = [
        (0, 2, true),
        (2, 2, true),
        (2, 2, true), // rewrite in place
        (4, 2, true), // evicts frame 1, keeps sink frame 0
        (6, 3, true), // evicts 2, 3, 4
        (6, 2, true), // rewrite part of the held range
        (8, 1, true),
        (9, 1, true),   // evicts 5
        (10, 5, false), // 5 new frames cannot fit beside a sink frame
        (3, 1, false),  // older than the newest held frame and not held
        (8, 3, false),  // 8, 9 held but 10 is not
        (12, 4, true),  // a gap is fine; evicts every non-sink frame
    ];
    for (i, &(first, n, ok)) in script.iter().enumerate() {
        let (k, v, ks, vs) = s.chunk(dev, &mut rng, n)?;
        let before = cache.frames().to_vec();
        let got = cache.write(first, &k, &v);
        assert_eq!(
            model.write(first, &ks, &vs),
            ok,
            "model disagrees with the script at {i}"
        );
        match (got, ok) {
            (Ok(()), true) => {}
            (Err(e), false) => {
                assert!(e.to_string().contains("KvCache::write"), "step {i}: {e}");
                assert_eq!(
                    cache.frames(),
                    &before[..],
                    "step {i}: a refused write changed the cache"
                );
            }
            (r, _) => panic!("step {i} ({first}, {n}): expected ok={ok}, got {r:?}"),
        }
        assert_matches(&s, &cache, &model, &format!("step {i}"))?;
    }
    assert_eq!(cache.frames(), &[0, 12, 13, 14, 15]);

    // Attention over the cache reads only what it holds and equals attention over those rows.
    let q = randn(dev, &mut rng, &[3, s.heads, s.hd])?;
    let held = cache.len_tokens();
    let a = ops::attention(&q, cache.keys(), cache.values(), held, AttnMask::None)?;
    let (k, v) = (
        cache.keys().narrow(0, 0, held)?,
        cache.values().narrow(0, 0, held)?,
    );
    let b = ops::attention(&q, &k, &v, held, AttnMask::None)?;
    assert_bits_eq("attention over the cache", &a.to_vec_f32(), &b.to_vec_f32());

    cache.clear();
    assert_eq!((cache.frames(), cache.len_tokens()), (&[][..], 0));
    Ok(())
}
test_device!(kv_cache_scripted, kv_cache_scripted_cpu);

/// Random appends, gaps and rewrites (some partly held, some stale) against the model.
fn kv_cache_random(dev: Device) -> Result<()> {
    dev.ensure_available()?;
    for (seed, s) in [
        (
            41,
            Setup {
                window: 6,
                sink: 2,
                tpf: 3,
                heads: 1,
                hd: 2,
            },
        ),
        (
            42,
            Setup {
                window: 4,
                sink: 0,
                tpf: 1,
                heads: 2,
                hd: 3,
            },
        ),
    ] {
        let mut rng = Rng::new(seed);
        let mut cache = KvCache::new(s.window, s.sink, s.tpf, s.heads, s.hd, DType::F32)?;
        let mut model = Model {
            window: s.window,
            sink: s.sink,
            frames: Vec::new(),
        };
        let mut next = 0u64;
        for step in 0..200 {
            let n = 1 + rng.below(s.window);
            let held = model.ids();
            let first = match rng.below(4) {
                0 if !held.is_empty() => held[rng.below(held.len())],
                1 if next > 0 => rng.below(next as usize) as u64,
                _ => next + rng.below(2) as u64,
            };
            let (k, v, ks, vs) = s.chunk(dev, &mut rng, n)?;
            let want = model.write(first, &ks, &vs);
            let got = cache.write(first, &k, &v);
            assert_eq!(
                got.is_ok(),
                want,
                "seed {seed} step {step}: write({first}, {n}) gave {got:?}"
            );
            if want {
                next = next.max(first + n as u64);
            }
            assert_matches(&s, &cache, &model, &format!("seed {seed} step {step}"))?;
        }
    }
    Ok(())
}
test_device!(kv_cache_random, kv_cache_random_cpu);

fn kv_cache_errors(dev: Device) -> Result<()> {
    let mut rng = Rng::new(43);
    assert!(KvCache::new(4, 4, 2, 1, 2, DType::F32).is_err());
    assert!(KvCache::new(0, 0, 2, 1, 2, DType::F32).is_err());
    assert!(KvCache::new(4, 1, 0, 1, 2, DType::F32).is_err());
    let mut cache = KvCache::new(3, 1, 2, 2, 4, DType::F32)?;
    let k = randn(dev, &mut rng, &[6, 2, 4])?;
    cache.write(0, &k, &k)?;
    let snapshot = cache.keys().to_vec_f32();
    // Each of these would need an eviction first: refusing must leave the cache as it was.
    let odd = randn(dev, &mut rng, &[3, 2, 4])?;
    let heads = randn(dev, &mut rng, &[2, 3, 4])?;
    let k2 = randn(dev, &mut rng, &[2, 2, 4])?;
    let bf = k2.to_dtype(DType::BF16)?;
    let cases: [(&str, &Tensor, &Tensor); 4] = [
        ("tokens not a whole frame", &odd, &odd),
        ("head count", &heads, &heads),
        ("k/v shapes", &k2, &odd),
        ("dtype", &bf, &bf),
    ];
    for (what, k, v) in cases {
        let r = cache.write(3, k, v);
        assert!(r.is_err(), "{what}: accepted");
        assert_eq!(
            cache.frames(),
            &[0, 1, 2],
            "{what}: frames changed by a refused write"
        );
        assert_bits_eq(what, &cache.keys().to_vec_f32(), &snapshot);
    }
    // A held tensor keeps its values when the cache writes over the storage it shares.
    let held = cache.keys().clone();
    let copy = cache.clone();
    let k3 = tensor(dev, rng.normals(16, 1.0), &[2, 2, 4])?;
    cache.write(3, &k3, &k3)?;
    assert_bits_eq("held keys", &held.to_vec_f32(), &snapshot);
    assert_eq!(copy.frames(), &[0, 1, 2]);
    assert_bits_eq("cloned cache", &copy.keys().to_vec_f32(), &snapshot);
    assert_eq!(cache.frames(), &[0, 2, 3]);
    Ok(())
}
test_device!(kv_cache_errors, kv_cache_errors_cpu);

/// The same frames held, and the same keys and values bit for bit.
#[track_caller]
fn assert_same_cache(what: &str, cache: &KvCache, plain: &KvCache) {
    assert_eq!(cache.frames(), plain.frames(), "{what}");
    let (k, pk) = (cache.keys().to_vec_f32(), plain.keys().to_vec_f32());
    assert_bits_eq(&format!("keys {what}"), &k, &pk);
    let (v, pv) = (cache.values().to_vec_f32(), plain.values().to_vec_f32());
    assert_bits_eq(&format!("values {what}"), &v, &pv);
}

/// `write_keys_with`: keys made in place by `ops::rms_norm_rope_into` land where `write` puts
/// the op's result, and keys that fail leave the frames they were to hold unheld.
fn kv_cache_keys_made_in_place(dev: Device) -> Result<()> {
    let mut rng = Rng::new(44);
    let (grid, table) = ([1, 1, 2], RopeTable::new(8, 64, 1e4)?);
    let mut cache = KvCache::new(3, 1, 2, 2, 8, DType::F32)?.on_device(dev)?;
    let mut plain = cache.clone();
    let w = randn(dev, &mut rng, &[16])?;
    for frame in [0u64, 1, 2, 3, 3, 5] {
        let (x, v) = (
            randn(dev, &mut rng, &[2, 2, 8])?,
            randn(dev, &mut rng, &[2, 2, 8])?,
        );
        let t = frame as usize;
        cache.write_keys_with(frame, &v, |keys, row| {
            ops::rms_norm_rope_into(&x, None, &w, 1e-6, grid, t, &table, keys, row)
        })?;
        plain.write(
            frame,
            &ops::rms_norm_rope(&x, None, &w, 1e-6, grid, t, &table)?,
            &v,
        )?;
        assert_same_cache(&format!("after frame {frame}"), &cache, &plain);
    }
    assert_eq!(cache.frames(), &[0, 3, 5]);
    let v = randn(dev, &mut rng, &[2, 2, 8])?;
    let refuse = |_: &mut Tensor, _| {
        Err(kernels::Error::Invalid {
            op: "test keys",
            msg: "refused".into(),
        })
    };
    // A failed rewrite leaves half-written rows: the frame goes, and every frame after it.
    assert!(cache.write_keys_with(3, &v, refuse).is_err());
    assert_eq!(cache.frames(), &[0], "after a failed rewrite");
    // A failed append holds nothing new.
    assert!(cache.write_keys_with(6, &v, refuse).is_err());
    assert_eq!(cache.frames(), &[0], "after a failed append");
    Ok(())
}
test_device!(kv_cache_keys_made_in_place, kv_cache_keys_made_in_place_cpu);

/// `write_with`: keys and values both made in place (`ops::rms_norm_rope_into`,
/// `ops::linear_into`) land where `write` puts the ops' results, and values that fail leave the
/// frames they were to hold unheld.
fn kv_cache_keys_and_values_made_in_place(dev: Device) -> Result<()> {
    let mut rng = Rng::new(45);
    let (grid, table) = ([1, 1, 2], RopeTable::new(8, 64, 1e4)?);
    let mut cache = KvCache::new(3, 1, 2, 2, 8, DType::F32)?.on_device(dev)?;
    let mut plain = cache.clone();
    let w = randn(dev, &mut rng, &[16])?;
    let (wv, bv) = (
        randn(dev, &mut rng, &[16, 24])?,
        randn(dev, &mut rng, &[16])?,
    );
    for frame in [0u64, 1, 2, 3, 3, 5] {
        let (k, x) = (
            randn(dev, &mut rng, &[2, 2, 8])?,
            randn(dev, &mut rng, &[2, 24])?,
        );
        let t = frame as usize;
        cache.write_with(
            frame,
            2,
            |keys, row| ops::rms_norm_rope_into(&k, None, &w, 1e-6, grid, t, &table, keys, row),
            |values, row| ops::linear_into(&x, &wv, Some(&bv), values, row),
        )?;
        plain.write(
            frame,
            &ops::rms_norm_rope(&k, None, &w, 1e-6, grid, t, &table)?,
            &ops::linear(&x, &wv, Some(&bv))?.reshape(&[2, 2, 8])?,
        )?;
        assert_same_cache(&format!("after frame {frame}"), &cache, &plain);
    }
    let keys = |keys: &mut Tensor, row| ops::write_rows(keys, row, &plain.keys().narrow(0, 0, 2)?);
    // Values with the wrong width: refused by `linear_into`, after the keys were written.
    let wide = randn(dev, &mut rng, &[24, 24])?;
    let x = randn(dev, &mut rng, &[2, 24])?;
    let bad = |values: &mut Tensor, row| ops::linear_into(&x, &wide, None, values, row);
    assert!(cache.write_with(3, 2, keys, bad).is_err());
    assert_eq!(cache.frames(), &[0], "after a failed rewrite");
    // Tokens that are not whole frames: refused before anything moves.
    let never = |_: &mut Tensor, _| -> Result<()> { panic!("called for a refused write") };
    assert!(cache.write_with(6, 3, never, never).is_err());
    assert_eq!(cache.frames(), &[0]);
    Ok(())
}
test_device!(
    kv_cache_keys_and_values_made_in_place,
    kv_cache_keys_and_values_made_in_place_cpu
);

/// (first frame, frames) written in turn into a cache of 6 frames with 2 sink frames: appends, a
/// rewrite in place, evictions of one and of several frames; it ends holding 0, 1, 8–11.
const WRITES: [(u64, usize); 8] = [
    (0, 2),
    (2, 3),
    (2, 3),
    (5, 1),
    (6, 2),
    (8, 3),
    (8, 3),
    (11, 1),
];

/// A cache that keeps an fp8 copy: after every write (appends, rewrites in place, evictions that
/// move rows) the copy reads as a store freshly quantized from the cache's rows. Frames of 50
/// tokens, so quantization tiles (128 keys) straddle frames and every write touches a tile that
/// holds older keys. Compared through the fp8 attention over what the cache holds.
fn kv_cache_fp8_copy_follows_every_write(dev: Device) -> Result<()> {
    let s = Setup {
        window: 6,
        sink: 2,
        tpf: 50,
        heads: 2,
        hd: 128,
    };
    let mut rng = Rng::new(44);
    let mut cache =
        KvCache::new(s.window, s.sink, s.tpf, s.heads, s.hd, DType::F32)?.with_fp8_attention()?;
    let q = randn(dev, &mut rng, &[7, s.heads, s.hd])?;
    for (step, (first, n)) in WRITES.into_iter().enumerate() {
        let (k, v, _, _) = s.chunk(dev, &mut rng, n)?;
        cache.write(first, &k, &v)?;
        let held = cache.len_tokens();
        let copy = cache.fp8().expect("the cache keeps an fp8 copy");
        let mut fresh = kernels::Fp8Kv::new(s.window * s.tpf, s.heads, dev)?;
        fresh.requantize(cache.keys(), cache.values(), 0..held, held)?;
        let a = kernels::attention_fp8(&q, copy, held)?;
        let b = kernels::attention_fp8(&q, &fresh, held)?;
        assert_bits_eq(
            &format!("step {step}: fp8 attention over the cache's copy"),
            &a.to_vec_f32(),
            &b.to_vec_f32(),
        );
    }
    assert_eq!(cache.frames(), &[0, 1, 8, 9, 10, 11]);
    // Head dims other than 128 have no fp8 kernel.
    assert!(KvCache::new(4, 1, 2, 2, 64, DType::F32)?
        .with_fp8_attention()
        .is_err());
    Ok(())
}
test_device!(
    kv_cache_fp8_copy_follows_every_write,
    kv_cache_fp8_copy_follows_every_write_cpu
);

/// A cache that keeps its keys' slab sums for VSA: after every write (appends, rewrites in
/// place, evictions that move rows) the sums of the held frames are, bit for bit, the sums of the
/// cache's keys made afresh; a cache asked for them once it holds frames sums what it holds.
fn kv_cache_key_sums_follow_every_write(dev: Device) -> Result<()> {
    let hw = [5, 6];
    let s = Setup {
        window: 6,
        sink: 2,
        tpf: 30,
        heads: 2,
        hd: 8,
    };
    let mut rng = Rng::new(45);
    let plain = KvCache::new(s.window, s.sink, s.tpf, s.heads, s.hd, DType::F32)?.on_device(dev)?;
    let mut cache = plain.clone().with_key_sums(hw)?;
    let slabs = kernels::vsa::slabs_per_frame(hw);
    let fresh = |c: &KvCache| -> Result<(Vec<f32>, Vec<f32>)> {
        let frames = c.frames().len();
        let kept = c.key_sums().expect("the cache keeps key sums");
        let want = kernels::vsa::frame_sums(c.keys(), 0, [frames, hw[0], hw[1]])?;
        Ok((
            kept.narrow(0, 0, frames * slabs)?.to_vec_f32(),
            want.to_vec_f32(),
        ))
    };
    for (step, (first, n)) in WRITES.into_iter().enumerate() {
        let (k, v, _, _) = s.chunk(dev, &mut rng, n)?;
        cache.write(first, &k, &v)?;
        let (kept, want) = fresh(&cache)?;
        assert_bits_eq(&format!("step {step}: key sums"), &kept, &want);
    }
    assert_eq!(cache.frames(), &[0, 1, 8, 9, 10, 11]);
    // Asked for on a cache that already holds frames.
    let mut late = plain;
    let (k, v, _, _) = s.chunk(dev, &mut rng, 3)?;
    late.write(0, &k, &v)?;
    let late = late.with_key_sums(hw)?;
    let (kept, want) = fresh(&late)?;
    assert_bits_eq("sums of frames held before", &kept, &want);
    // A frame shape that is not the cache's is refused.
    let msg = KvCache::new(4, 1, 30, 1, 8, DType::F32)?
        .with_key_sums([4, 6])
        .expect_err("24 tokens a frame")
        .to_string();
    assert!(msg.contains("tokens per frame"), "{msg}");
    Ok(())
}
test_device!(
    kv_cache_key_sums_follow_every_write,
    kv_cache_key_sums_follow_every_write_cpu
);

/// `write_with_sums`: keys and their slab sums both made by the launch that writes the keys
/// (`ops::rms_norm_rope_into_sums`) hold, after every write (appends, rewrites, evictions), the
/// keys a cache written with the plain op holds and the sums of those keys made afresh; a maker
/// that says it left the sums alone gets them made by the cache.
fn kv_cache_key_sums_made_with_the_keys(dev: Device) -> Result<()> {
    let hw = [5, 6];
    let s = Setup {
        window: 6,
        sink: 2,
        tpf: 30,
        heads: 2,
        hd: 8,
    };
    let mut rng = Rng::new(46);
    let table = RopeTable::new(s.hd, 64, 1e4)?;
    let w = randn(dev, &mut rng, &[s.heads * s.hd])?;
    let plain = KvCache::new(s.window, s.sink, s.tpf, s.heads, s.hd, DType::F32)?.on_device(dev)?;
    let mut cache = plain.clone().with_key_sums(hw)?;
    let mut twin = plain.with_key_sums(hw)?;
    let slabs = kernels::vsa::slabs_per_frame(hw);
    for (step, (first, n)) in WRITES.into_iter().enumerate() {
        let (x, v, _, _) = s.chunk(dev, &mut rng, n)?;
        let (grid, t) = ([n, hw[0], hw[1]], first as usize);
        let values = |vals: &mut Tensor, row| ops::write_rows(vals, row, &v);
        // Even steps make the sums with the keys, odd ones leave them to the cache.
        cache.write_with_sums(
            first,
            n * s.tpf,
            |keys, row, sums| match sums {
                Some(r) if step % 2 == 0 => {
                    assert_eq!(r.hw, hw, "step {step}: the cache's frame shape");
                    ops::rms_norm_rope_into_sums(
                        &x, None, &w, 1e-6, grid, t, &table, keys, row, r.sums, r.row,
                    )?;
                    Ok(true)
                }
                _ => {
                    ops::rms_norm_rope_into(&x, None, &w, 1e-6, grid, t, &table, keys, row)?;
                    Ok(false)
                }
            },
            values,
        )?;
        twin.write_with(
            first,
            n * s.tpf,
            |keys, row| ops::rms_norm_rope_into(&x, None, &w, 1e-6, grid, t, &table, keys, row),
            values,
        )?;
        assert_same_cache(&format!("step {step}"), &cache, &twin);
        let frames = cache.frames().len();
        let kept = cache.key_sums().expect("the cache keeps key sums");
        let want = kernels::vsa::frame_sums(cache.keys(), 0, [frames, hw[0], hw[1]])?;
        assert_bits_eq(
            &format!("step {step}: key sums"),
            &kept.narrow(0, 0, frames * slabs)?.to_vec_f32(),
            &want.to_vec_f32(),
        );
    }
    assert_eq!(cache.frames(), &[0, 1, 8, 9, 10, 11]);
    Ok(())
}
test_device!(
    kv_cache_key_sums_made_with_the_keys,
    kv_cache_key_sums_made_with_the_keys_cpu
);
