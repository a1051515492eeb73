//! Bounded label values.
//!
//! * [`bounded_label`]: no label value is longer than its cap or holds a control character,
//!   `~`, `"` or `\`. A value that would is replaced by a *marked* value: its leading run of
//!   plain characters (cut to leave room) + `~` + 16 hex digits of a stable hash of the whole
//!   value. A raw value never contains `~`, so a marked value cannot be mistaken for one, and
//!   the raw string never reaches `/metrics`. Models, request types and business lines are cut
//!   at [`MAX_NAME_LABEL_BYTES`], users at [`MAX_USER_LABEL_BYTES`].
//! * [`ModelLabeler`]: at most `max` distinct values plus `other`. Names can be *reserved*
//!   ([`ModelLabeler::reserve`]: the models the upstreams serve, from the config and their
//!   `/v1/models`); at most `max` are. A reserved name always keeps its label; a name nobody
//!   reserved (a client's choice) gets a label only while the reserved and the other admitted
//!   names together are fewer than `max`, else `other`. A name reserved after client names took
//!   the free slots still gets its label, so the worst case is `2·max` values (at most `max`
//!   reserved + fewer than `max` admitted before); with the reservations made at start-up it is
//!   `max`.
//! * [`UserLabeler`]: users never become labels directly. In `hash` mode a user maps to one of
//!   N stable buckets (`u00` … `uNN`; `anonymous` when unknown). In `top_k` mode the heaviest
//!   users by tokens keep their own (bounded, [`MAX_USER_LABEL_BYTES`]) name and everyone else
//!   is `other`; the top set is recomputed every 1,024 observations from a space-saving sketch
//!   of fixed size keyed by the bounded name, and the number of distinct names ever emitted is
//!   capped at `2·k`, so the series count stays bounded even when the ranking churns.

use parking_lot::{Mutex, RwLock};
use std::borrow::Cow;
use std::collections::{HashMap, HashSet};

/// Longest model / request-type / business-line label, bytes.
pub const MAX_NAME_LABEL_BYTES: usize = 128;
/// Longest user label (`top_k` mode), bytes.
pub const MAX_USER_LABEL_BYTES: usize = 64;

fn plain(c: char) -> bool {
    !c.is_control() && !matches!(c, '~' | '"' | '\\')
}

/// `value` when it has at most `max` bytes (`max` ≥ 17) and only plain characters, else the
/// marked form `prefix~hhhhhhhhhhhhhhhh` of at most `max` bytes (module docs).
pub fn bounded_label(value: &str, max: usize) -> Cow<'_, str> {
    if value.len() <= max && value.chars().all(plain) {
        return Cow::Borrowed(value);
    }
    let room = max.saturating_sub(17);
    let mut end = 0;
    for (i, c) in value.char_indices() {
        if !plain(c) || i + c.len_utf8() > room {
            break;
        }
        end = i + c.len_utf8();
    }
    Cow::Owned(format!(
        "{}~{:016x}",
        &value[..end],
        fnv1a(value.as_bytes())
    ))
}

/// Limits a label to `max` distinct values plus `other`, reserved names first (module docs).
#[derive(Debug)]
pub struct ModelLabeler {
    max: usize,
    known: RwLock<Known>,
}

#[derive(Debug, Default)]
struct Known {
    reserved: HashSet<String>,
    admitted: HashSet<String>,
}

impl ModelLabeler {
    /// A labeler keeping at most `max` distinct values.
    pub fn new(max: usize) -> Self {
        Self {
            max,
            known: RwLock::new(Known::default()),
        }
    }

    /// Reserves labels for `names` (the models the upstreams serve), while fewer than `max`
    /// are reserved. Returns how many were newly reserved.
    pub fn reserve<S: AsRef<str>>(&self, names: impl IntoIterator<Item = S>) -> usize {
        let mut k = self.known.write();
        let mut added = 0;
        for n in names {
            let n = n.as_ref();
            if n.is_empty() {
                continue;
            }
            let n = bounded_label(n, MAX_NAME_LABEL_BYTES);
            if k.reserved.contains(n.as_ref()) || k.reserved.len() >= self.max {
                continue;
            }
            // A name admitted earlier moves to the reserved set (its slot frees up).
            k.admitted.remove(n.as_ref());
            k.reserved.insert(n.into_owned());
            added += 1;
        }
        added
    }

    /// The label for `value`.
    pub fn label(&self, value: &str) -> String {
        let value = if value.is_empty() { "unknown" } else { value };
        let value = bounded_label(value, MAX_NAME_LABEL_BYTES);
        {
            let k = self.known.read();
            if k.reserved.contains(value.as_ref()) || k.admitted.contains(value.as_ref()) {
                return value.into_owned();
            }
        }
        let mut k = self.known.write();
        if k.reserved.contains(value.as_ref())
            || k.admitted.contains(value.as_ref())
            || k.reserved.len() + k.admitted.len() < self.max
        {
            if !k.reserved.contains(value.as_ref()) {
                k.admitted.insert(value.to_string());
            }
            value.into_owned()
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
            // The sketch counts the bounded form: neither the label nor the sketch's memory
            // grows with the length of an id.
            UserLabelMode::TopK { k } => self.top_k(
                &bounded_label(user, MAX_USER_LABEL_BYTES),
                weight.max(1),
                *k,
            ),
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
    fn bounded_labels_mark_long_and_odd_values() {
        assert_eq!(bounded_label("alice", 64), "alice");
        assert_eq!(
            bounded_label("Llama-3.1-8B/Instruct:q4", 64),
            "Llama-3.1-8B/Instruct:q4"
        );
        assert_eq!(bounded_label("用户", 64), "用户");
        let long = "x".repeat(1024);
        let b = bounded_label(&long, 64);
        assert_eq!(b.len(), 64, "{b}");
        assert!(b.starts_with(&"x".repeat(47)) && b.contains('~'), "{b}");
        // Stable, and distinct ids stay distinct.
        assert_eq!(b, bounded_label(&long, 64));
        assert_ne!(b, bounded_label(&"x".repeat(1023), 64));
        let odd = bounded_label("bob\nEVIL{x=\"y\"}", 64);
        assert!(odd.starts_with("bob~") && odd.len() == 20, "{odd}");
        // A raw value cannot look like a marked one.
        let tilde = bounded_label("a~0123456789abcdef", 64);
        assert_ne!(tilde, "a~0123456789abcdef");
        assert!(bounded_label("\u{1}", 64).starts_with('~'));
    }

    #[test]
    fn top_k_user_labels_are_bounded() {
        let l = UserLabeler::new(UserLabelMode::TopK { k: 4 });
        let long = "u".repeat(1024);
        let label = l.label(Some(&long), 1000);
        assert!(label.len() <= MAX_USER_LABEL_BYTES, "{}", label.len());
        assert!(label.contains('~'), "{label}");
        assert_eq!(l.label(Some(&long), 1), label);
        assert_eq!(l.label(Some("carol"), 1000), "carol");
    }

    #[test]
    fn reserved_models_keep_their_label() {
        let m = ModelLabeler::new(3);
        assert_eq!(m.reserve(["real-a", "real-b"]), 2);
        assert_eq!(m.label("junk-1"), "junk-1");
        assert_eq!(m.label("junk-2"), "other");
        assert_eq!(m.label("real-b"), "real-b");
        assert_eq!(m.label("real-a"), "real-a");
        // Reserved late (after client names took the slots): still labelled.
        assert_eq!(m.reserve(["real-c"]), 1);
        assert_eq!(m.label("real-c"), "real-c");
        // At most `max` names are reserved.
        assert_eq!(m.reserve(["real-d"]), 0);
        assert_eq!(m.label("real-d"), "other");
        assert_eq!(m.label("junk-1"), "junk-1");
        // A long client name is marked, never raw.
        let m = ModelLabeler::new(10);
        let l = m.label(&"m".repeat(4096));
        assert!(l.len() <= MAX_NAME_LABEL_BYTES && l.contains('~'), "{l}");
    }

    #[test]
    fn model_limit() {
        let m = ModelLabeler::new(1);
        assert_eq!(m.label("a"), "a");
        assert_eq!(m.label("b"), "other");
        assert_eq!(m.label("a"), "a");
    }
}
