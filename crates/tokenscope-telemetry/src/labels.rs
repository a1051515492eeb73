//! Bounded label values.
//!
//! * [`ModelLabeler`]: the first `max` distinct names keep their own label; later ones become
//!   `other`. A model name is set by the operator's config in practice, so the limit only
//!   protects against clients sending arbitrary `model` strings.
//! * [`UserLabeler`]: users never become labels directly. In `hash` mode a user maps to one of
//!   N stable buckets (`u00` … `uNN`; `anonymous` when unknown). In `top_k` mode the heaviest
//!   users by tokens keep their own name and everyone else is `other`; the top set is
//!   recomputed every 1,024 observations from a space-saving sketch of fixed size, and the
//!   number of distinct names ever emitted is capped at `2·k`, so the series count stays bounded
//!   even when the ranking churns.

use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, HashSet};

/// Limits a label to `max` distinct values plus `other`.
#[derive(Debug)]
pub struct ModelLabeler {
    max: usize,
    known: RwLock<HashSet<String>>,
}

impl ModelLabeler {
    /// A labeler keeping at most `max` distinct values.
    pub fn new(max: usize) -> Self {
        Self {
            max,
            known: RwLock::new(HashSet::new()),
        }
    }

    /// The label for `value`.
    pub fn label(&self, value: &str) -> String {
        let value = if value.is_empty() { "unknown" } else { value };
        if self.known.read().contains(value) {
            return value.to_owned();
        }
        let mut known = self.known.write();
        if known.contains(value) || known.len() < self.max {
            known.insert(value.to_owned());
            value.to_owned()
        } else {
            "other".to_owned()
        }
    }
}

/// How users become the `user_bucket` label.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UserLabelMode {
    /// Stable hash into `buckets` buckets.
    Hash {
        /// Number of buckets (label values `u00`…).
        buckets: u32,
    },
    /// The `k` heaviest users by tokens keep their name; the rest are `other`.
    TopK {
        /// How many users keep their own label.
        k: usize,
    },
}

/// Maps a user to a bounded label. See the module docs.
#[derive(Debug)]
pub struct UserLabeler {
    mode: UserLabelMode,
    top: Mutex<TopK>,
}

#[derive(Debug, Default)]
struct TopK {
    counts: HashMap<String, u64>,
    current: HashSet<String>,
    emitted: HashSet<String>,
    since_recompute: u32,
}

impl UserLabeler {
    /// A labeler in `mode`.
    pub fn new(mode: UserLabelMode) -> Self {
        Self {
            mode,
            top: Mutex::new(TopK::default()),
        }
    }

    /// The label of `user`, who just used `weight` tokens.
    pub fn label(&self, user: Option<&str>, weight: u64) -> String {
        let Some(user) = user.filter(|u| !u.is_empty()) else {
            return "anonymous".to_owned();
        };
        match &self.mode {
            UserLabelMode::Hash { buckets } => {
                let n = (*buckets).max(1);
                format!("u{:02}", fnv1a(user.as_bytes()) % u64::from(n))
            }
            UserLabelMode::TopK { k } => self.top_k(user, weight.max(1), *k),
        }
    }

    fn top_k(&self, user: &str, weight: u64, k: usize) -> String {
        let mut t = self.top.lock();
        let capacity = (k * 8).max(64);
        // Space-saving: when full, the smallest entry is replaced and inherits its count.
        if let Some(c) = t.counts.get_mut(user) {
            *c += weight;
        } else if t.counts.len() < capacity {
            t.counts.insert(user.to_owned(), weight);
        } else if let Some((min_user, min)) = t
            .counts
            .iter()
            .min_by_key(|(_, c)| **c)
            .map(|(u, c)| (u.clone(), *c))
        {
            t.counts.remove(&min_user);
            t.counts.insert(user.to_owned(), min + weight);
        }
        t.since_recompute += 1;
        if t.since_recompute >= 1024 || t.current.len() < k.min(t.counts.len()) {
            t.since_recompute = 0;
            let mut all: Vec<(&String, &u64)> = t.counts.iter().collect();
            all.sort_unstable_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
            let cap = 2 * k;
            let emitted = t.emitted.clone();
            let next: HashSet<String> = all
                .into_iter()
                .map(|(u, _)| u)
                .filter(|u| emitted.contains(*u) || emitted.len() < cap)
                .take(k)
                .cloned()
                .collect();
            for u in &next {
                if t.emitted.len() < cap || t.emitted.contains(u) {
                    t.emitted.insert(u.clone());
                }
            }
            t.current = next;
        }
        if t.current.contains(user) && t.emitted.contains(user) {
            user.to_owned()
        } else {
            "other".to_owned()
        }
    }
}

/// FNV-1a, stable across processes and versions (unlike `DefaultHasher`).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_buckets_are_stable_and_bounded() {
        let l = UserLabeler::new(UserLabelMode::Hash { buckets: 4 });
        let a = l.label(Some("alice"), 1);
        assert_eq!(a, l.label(Some("alice"), 100));
        let mut seen = HashSet::new();
        for i in 0..1000 {
            seen.insert(l.label(Some(&format!("user{i}")), 1));
        }
        assert!(seen.len() <= 4);
        assert_eq!(l.label(None, 1), "anonymous");
    }

    #[test]
    fn top_k_keeps_heavy_users() {
        let l = UserLabeler::new(UserLabelMode::TopK { k: 2 });
        for _ in 0..50 {
            l.label(Some("heavy1"), 1000);
            l.label(Some("heavy2"), 900);
        }
        let mut labels = HashSet::new();
        for i in 0..5000 {
            labels.insert(l.label(Some(&format!("light{i}")), 1));
        }
        assert_eq!(l.label(Some("heavy1"), 1000), "heavy1");
        assert_eq!(l.label(Some("heavy2"), 1000), "heavy2");
        assert!(labels.len() <= 5, "{labels:?}");
    }

    #[test]
    fn model_limit() {
        let m = ModelLabeler::new(1);
        assert_eq!(m.label("a"), "a");
        assert_eq!(m.label("b"), "other");
        assert_eq!(m.label("a"), "a");
    }
}
