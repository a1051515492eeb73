//! What a load test sends and when: arrival schedules, the prompt-length mix and prompt text.
//!
//! Pure and deterministic for a given seed (all randomness comes from one [`fastrand::Rng`]).
//!
//! ## Invariants
//!
//! * A schedule is a sorted list of offsets from the level start, every offset `< duration`.
//!   Constant arrivals: offset `i / rate` for `i = 0, 1, …` (exactly `⌈rate × duration⌉`
//!   requests). Poisson arrivals: cumulative exponential inter-arrival gaps `−ln(U) / rate`,
//!   `U` uniform in `(0, 1]`, so the count in a window is Poisson(`rate × duration`).
//! * A mix is a list of `(weight %, min, max)` classes with weights summing to 100; a request
//!   picks a class with probability weight/100, then a length uniform in `min..=max`.
//! * [`prompt_text`] of `n` tokens is `n` words drawn from [`WORDS`]: common English words of
//!   1–4 characters, each exactly one token under the mock's toy tokenizer
//!   (`ceil(chars / 4)` = 1) and, with its leading space, one token in common BPE vocabularies
//!   (GPT/Llama-style) — so `tokenscope_mock::count_tokens(prompt_text(n)) == n` exactly and
//!   real tokenizers land near `n`.

use std::fmt;
use std::time::Duration;
use thiserror::Error;

/// Common short English words, each 1–4 characters (one toy-tokenizer token each).
pub const WORDS: &[&str] = &[
    "the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are",
    "as", "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by",
    "word", "but", "not", "what", "all", "were", "we", "when", "your", "can", "said", "use", "an",
    "each", "she", "do", "how", "if", "will", "up", "out", "many", "then", "them", "so", "some",
    "her", "make", "like", "him", "into", "time", "has", "look", "two", "more", "go", "see", "no",
    "way", "my", "than", "been", "call", "who", "its", "now", "find", "long", "down", "day", "did",
    "get", "come", "made", "may", "part", "over", "new", "work", "life", "only", "year", "back",
    "good", "give", "most", "very", "just", "name", "form", "much", "also", "tell", "show", "home",
    "read", "hand", "move", "play", "turn", "city", "tree",
];

/// How requests arrive (`bench --arrival`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Arrival {
    /// Evenly spaced, `1 / rate` apart.
    #[value(alias = "uniform")]
    Constant,
    /// A Poisson process: exponential inter-arrival gaps with mean `1 / rate`.
    Poisson,
}

/// An invalid `--mix` value.
#[derive(Debug, Error, PartialEq)]
pub enum PlanError {
    /// A malformed mix.
    #[error("invalid mix {spec:?}: {why}")]
    Mix {
        /// The spec as given.
        spec: String,
        /// What is wrong.
        why: String,
    },
}

/// Offsets from the level start at which requests are sent (see the module invariants).
pub fn schedule(
    arrival: Arrival,
    rate: f64,
    duration: Duration,
    rng: &mut fastrand::Rng,
) -> Vec<Duration> {
    let mut out = Vec::new();
    if !(rate.is_finite() && rate > 0.0) {
        return out;
    }
    let end = duration.as_secs_f64();
    match arrival {
        Arrival::Constant => {
            let mut i = 0u64;
            loop {
                let t = i as f64 / rate;
                if t >= end {
                    break;
                }
                out.push(Duration::from_secs_f64(t));
                i += 1;
            }
        }
        Arrival::Poisson => {
            let mut t = 0.0;
            loop {
                // 1 − U with U in [0, 1) is in (0, 1]: ln is finite.
                let u = 1.0 - rng.f64();
                t += -u.ln() / rate;
                if t >= end {
                    break;
                }
                out.push(Duration::from_secs_f64(t));
            }
        }
    }
    out
}

/// One class of a prompt mix: `weight` percent of requests get `min..=max` prompt tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MixClass {
    /// Percent of requests (the classes of a mix sum to 100).
    pub weight: f64,
    /// Fewest prompt tokens.
    pub min: u64,
    /// Most prompt tokens.
    pub max: u64,
}

/// A prompt-length mix, e.g. `80:64-256,20:2048-4096`.
#[derive(Debug, Clone, PartialEq)]
pub struct Mix(pub Vec<MixClass>);

impl fmt::Display for Mix {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self
            .0
            .iter()
            .map(|c| format!("{}:{}-{}", c.weight, c.min, c.max))
            .collect();
        f.write_str(&parts.join(","))
    }
}

impl std::str::FromStr for Mix {
    type Err = PlanError;
    /// `PCT:MIN-MAX[,PCT:MIN-MAX…]` (a bare `MIN-MAX` or `N` is one class of 100 %); weights
    /// must be positive and sum to 100 (± 0.001), `1 ≤ MIN ≤ MAX`.
    fn from_str(spec: &str) -> Result<Self, PlanError> {
        let bad = |why: &str| PlanError::Mix {
            spec: spec.to_owned(),
            why: why.to_owned(),
        };
        let mut classes = Vec::new();
        for part in spec.split(',').map(str::trim) {
            if part.is_empty() {
                return Err(bad("empty class"));
            }
            let (weight, range) = match part.split_once(':') {
                Some((w, r)) => (
                    w.trim()
                        .trim_end_matches('%')
                        .parse::<f64>()
                        .map_err(|_| bad("weight is not a number"))?,
                    r,
                ),
                None => (100.0, part),
            };
            let (min, max) = match range.split_once('-') {
                Some((a, b)) => (a.trim(), b.trim()),
                None => (range.trim(), range.trim()),
            };
            let min: u64 = min.parse().map_err(|_| bad("length is not an integer"))?;
            let max: u64 = max.parse().map_err(|_| bad("length is not an integer"))?;
            if !(weight.is_finite() && weight > 0.0) {
                return Err(bad("weights must be positive"));
            }
            if min == 0 || min > max {
                return Err(bad("need 1 <= MIN <= MAX"));
            }
            classes.push(MixClass { weight, min, max });
        }
        let total: f64 = classes.iter().map(|c| c.weight).sum();
        if (total - 100.0).abs() > 1e-3 {
            return Err(bad("weights must sum to 100"));
        }
        Ok(Mix(classes))
    }
}

impl Mix {
    /// A prompt length drawn from the mix.
    pub fn sample(&self, rng: &mut fastrand::Rng) -> u64 {
        let mut x = rng.f64() * 100.0;
        let last = self.0.len().saturating_sub(1);
        for (i, c) in self.0.iter().enumerate() {
            if x < c.weight || i == last {
                return rng.u64(c.min..=c.max);
            }
            x -= c.weight;
        }
        1
    }
}

/// `n` random words from [`WORDS`], separated by single spaces (exactly `n` toy tokens).
pub fn prompt_text(n: u64, rng: &mut fastrand::Rng) -> String {
    let mut s = String::with_capacity(n as usize * 5);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORDS[rng.usize(..WORDS.len())]);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix_parses_and_rejects() {
        let m: Mix = "80:64-256,20:2048-4096".parse().expect("mix");
        assert_eq!(
            m.0,
            vec![
                MixClass {
                    weight: 80.0,
                    min: 64,
                    max: 256
                },
                MixClass {
                    weight: 20.0,
                    min: 2048,
                    max: 4096
                },
            ]
        );
        assert_eq!(
            "128".parse::<Mix>().expect("single").0,
            vec![MixClass {
                weight: 100.0,
                min: 128,
                max: 128
            }]
        );
        assert_eq!("100%:10-20".parse::<Mix>().expect("pct").0[0].max, 20);
        for bad in [
            "",
            "80:64-256",
            "50:10-5,50:1-2",
            "50:0-5,50:1-2",
            "x:1-2",
            "100:a-b",
            "60:1-2,,40:1-2",
            "-10:1-2,110:1-2",
        ] {
            assert!(bad.parse::<Mix>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn mix_sampling_respects_ranges_and_weights() {
        let m: Mix = "80:64-256,20:2048-4096".parse().expect("mix");
        let mut rng = fastrand::Rng::with_seed(7);
        let n = 10_000;
        let mut long = 0;
        for _ in 0..n {
            let x = m.sample(&mut rng);
            assert!((64..=256).contains(&x) || (2048..=4096).contains(&x), "{x}");
            if x >= 2048 {
                long += 1;
            }
        }
        // Binomial(10000, 0.2): sd = 40; 5 sd.
        assert!((long as f64 - 2000.0).abs() < 200.0, "{long}");
    }

    #[test]
    fn prompts_are_exact_under_the_mock_tokenizer() {
        assert!(WORDS.iter().all(|w| (1..=4).contains(&w.chars().count())));
        let mut rng = fastrand::Rng::with_seed(1);
        for n in [1u64, 2, 3, 64, 255, 2048, 4096] {
            let p = prompt_text(n, &mut rng);
            assert_eq!(tokenscope_mock::count_tokens(&p), n);
            assert_eq!(p.split(' ').count() as u64, n);
        }
        // Through the mix, too.
        let m: Mix = "80:64-256,20:2048-4096".parse().expect("mix");
        for _ in 0..50 {
            let n = m.sample(&mut rng);
            assert_eq!(tokenscope_mock::count_tokens(&prompt_text(n, &mut rng)), n);
        }
    }

    #[test]
    fn constant_schedule_is_exact() {
        let mut rng = fastrand::Rng::with_seed(0);
        let s = schedule(Arrival::Constant, 4.0, Duration::from_secs(2), &mut rng);
        let ms: Vec<u128> = s.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, vec![0, 250, 500, 750, 1000, 1250, 1500, 1750]);
        assert_eq!(
            schedule(
                Arrival::Constant,
                3.0,
                Duration::from_millis(1100),
                &mut rng
            )
            .len(),
            4
        );
        assert!(schedule(Arrival::Poisson, 0.0, Duration::from_secs(2), &mut rng).is_empty());
    }

    #[test]
    fn poisson_schedule_has_the_requested_rate() {
        let mut rng = fastrand::Rng::with_seed(42);
        let rate = 50.0;
        let s = schedule(Arrival::Poisson, rate, Duration::from_secs(200), &mut rng);
        assert!(s.windows(2).all(|w| w[0] <= w[1]));
        assert!(s.iter().all(|d| d.as_secs_f64() < 200.0));
        // Count ~ Poisson(10000): sd = 100; allow 4 sd.
        let n = s.len() as f64;
        assert!((n - 10_000.0).abs() < 400.0, "{n}");
        // Inter-arrival gaps: mean 1/rate, and exponential: sd ≈ mean.
        let gaps: Vec<f64> = s.windows(2).map(|w| (w[1] - w[0]).as_secs_f64()).collect();
        let mean = gaps.iter().sum::<f64>() / gaps.len() as f64;
        let var = gaps.iter().map(|g| (g - mean).powi(2)).sum::<f64>() / gaps.len() as f64;
        assert!((mean - 0.02).abs() < 0.02 * 0.04, "{mean}");
        assert!(
            (var.sqrt() / mean - 1.0).abs() < 0.05,
            "cv {}",
            var.sqrt() / mean
        );
        // Same seed, same schedule.
        let again = schedule(
            Arrival::Poisson,
            rate,
            Duration::from_secs(200),
            &mut fastrand::Rng::with_seed(42),
        );
        assert_eq!(s, again);
    }
}
