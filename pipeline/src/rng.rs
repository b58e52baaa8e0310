//! Seeded random numbers owned by the project, so noise and random weights are the same on every
//! machine, backend and card count, and do not change when a dependency is upgraded.

/// SplitMix64 stream with Box–Muller normals.
#[derive(Clone, Debug)]
pub struct NormalRng {
    state: u64,
    spare: Option<f64>,
}

impl NormalRng {
    pub fn new(seed: u64) -> Self {
        NormalRng {
            state: seed,
            spare: None,
        }
    }

    /// A stream for a named purpose (a weight key, a session), independent of draw order
    /// elsewhere.
    pub fn for_name(seed: u64, name: &str) -> Self {
        // FNV-1a over the name, mixed with the seed.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        for b in name.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        Self::new(h)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1].
    fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }

    pub fn normal(&mut self) -> f64 {
        if let Some(s) = self.spare.take() {
            return s;
        }
        let (u1, u2) = (self.uniform(), self.uniform());
        let r = (-2.0 * u1.ln()).sqrt();
        let a = std::f64::consts::TAU * u2;
        self.spare = Some(r * a.sin());
        r * a.cos()
    }

    /// `n` standard normal values as f32.
    pub fn normals(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.normal() as f32).collect()
    }

    /// The first `n` values [`normals`](Self::normals) gives on a fresh stream from `state`,
    /// computed on all cores. SplitMix64 is a counter, so the stream can be entered at any
    /// pair of draws: random weights of a 14B model take seconds instead of minutes.
    pub fn normals_par(state: u64, n: usize) -> Vec<f32> {
        use rayon::prelude::*;
        // Pairs per task: large enough that task overhead vanishes, a multiple of 2 values.
        const PAIRS: usize = 1 << 15;
        let mut out = vec![0f32; n];
        out.par_chunks_mut(2 * PAIRS)
            .enumerate()
            .for_each(|(task, chunk)| {
                let draws_before = (task * 2 * PAIRS) as u64;
                let mut rng = NormalRng::new(
                    state.wrapping_add(draws_before.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
                );
                for v in chunk.iter_mut() {
                    *v = rng.normal() as f32;
                }
            });
        out
    }

    /// [`normals`](Self::normals), computed on all cores when the stream stands at a pair
    /// boundary and `n` is even, which then leaves the stream where `normals` would: each
    /// value takes one step of the counter. A chunk's noise (300k values at 480×832) is drawn
    /// between forwards while a card may wait, so it should not take one core's milliseconds.
    pub fn normals_fast(&mut self, n: usize) -> Vec<f32> {
        if self.spare.is_some() || !n.is_multiple_of(2) || n < 1 << 16 {
            return self.normals(n);
        }
        let out = Self::normals_par(self.state, n);
        self.state = self
            .state
            .wrapping_add((n as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        out
    }

    /// The stream's state, to hand to [`normals_par`](Self::normals_par).
    pub fn state(&self) -> u64 {
        self.state
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normals_have_unit_moments_and_are_reproducible() {
        let a = NormalRng::new(7).normals(200_000);
        let b = NormalRng::new(7).normals(200_000);
        assert_eq!(a, b);
        let n = a.len() as f64;
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = a.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.02, "var {var}");
        // Entering the stream at task boundaries gives the sequential values, odd lengths too.
        for n in [1, 7, (1 << 16) - 1, (1 << 16) + 3, 200_001] {
            let seq = NormalRng::for_name(3, "w").normals(n);
            let par = NormalRng::normals_par(NormalRng::for_name(3, "w").state(), n);
            assert_eq!(seq, par, "n = {n}");
        }
        // The fast path draws what the sequential one draws, and leaves the stream in the same
        // place, through a mix of even, odd and short draws.
        let (mut seq, mut fast) = (NormalRng::new(11), NormalRng::new(11));
        for n in [299_520, 3, 200_000, 1 << 16, 5, 299_520] {
            assert_eq!(seq.normals(n), fast.normals_fast(n), "n = {n}");
        }
        assert_eq!(seq.next_u64(), fast.next_u64());
        assert_ne!(
            NormalRng::for_name(1, "a").next_u64(),
            NormalRng::for_name(1, "b").next_u64()
        );
    }
}
