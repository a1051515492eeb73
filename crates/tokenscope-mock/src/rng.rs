//! A tiny deterministic PRNG (splitmix64) and the natural output-length distribution.

/// Median of the natural output length, tokens.
const MEDIAN_LEN: f64 = 120.0;
/// Standard deviation of the natural length in log space.
const LOG_SIGMA: f64 = 0.7;
/// Hard ceiling of the natural length, tokens.
const MAX_NATURAL: u64 = 8192;

/// splitmix64 (Steele, Lea, Flood 2014): tiny, fast, statistically fine for a simulator.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`, 53 bits.
    pub(crate) fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The natural (EOS) length of request number `n` under `seed`: log-normal, median
/// [`MEDIAN_LEN`], clamped to `1..=MAX_NATURAL`. Deterministic in `(seed, n)`.
pub(crate) fn natural_len(seed: u64, n: u64) -> u64 {
    let mut r = SplitMix64::new(seed ^ n.wrapping_mul(0xD1B5_4A32_D192_ED03));
    // Warm up so that nearby (seed, n) pairs decorrelate.
    r.next_u64();
    // Box–Muller; u1 in (0, 1] so ln is finite.
    let u1 = 1.0 - r.next_f64();
    let u2 = r.next_f64();
    let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
    let len = (MEDIAN_LEN * (LOG_SIGMA * z).exp()).round();
    if len.is_finite() {
        (len as u64).clamp(1, MAX_NATURAL)
    } else {
        MEDIAN_LEN as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deterministic_and_plausible() {
        let a: Vec<u64> = (0..2000).map(|n| natural_len(42, n)).collect();
        let b: Vec<u64> = (0..2000).map(|n| natural_len(42, n)).collect();
        assert_eq!(a, b);
        assert_ne!(a, (0..2000).map(|n| natural_len(7, n)).collect::<Vec<_>>());
        let mut sorted = a.clone();
        sorted.sort_unstable();
        let median = sorted[sorted.len() / 2];
        assert!((100..=140).contains(&median), "median {median}");
        assert!(a.iter().all(|&l| (1..=MAX_NATURAL).contains(&l)));
    }

    #[test]
    fn uniform_in_unit_interval() {
        let mut r = SplitMix64::new(1);
        for _ in 0..10_000 {
            let x = r.next_f64();
            assert!((0.0..1.0).contains(&x));
        }
    }
}
