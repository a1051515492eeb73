//! Model name → tokenizer index.
//!
//! Patterns: an exact model name, `"prefix*"` (a trailing `*` only), or `"*"` (every model).
//! Precedence, independent of config order: an exact name beats any prefix, a longer prefix beats
//! a shorter one, and `"*"` is used only when nothing else matches. Matching is case-sensitive
//! (model names are identifiers). Invariant: a pattern maps to exactly one tokenizer; the same
//! pattern twice (even in the same entry) is a startup error, so the precedence rules above are
//! total and lookups are deterministic.

use crate::error::TokenizeError;
use std::collections::HashMap;

/// Routes model names to tokenizer indices.
#[derive(Debug, Clone, Default)]
pub(crate) struct Router {
    exact: HashMap<String, usize>,
    /// Sorted by prefix length, longest first.
    prefixes: Vec<(String, usize)>,
    wildcard: Option<usize>,
}

impl Router {
    /// Adds the patterns of tokenizer `index`.
    pub(crate) fn add(&mut self, patterns: &[String], index: usize) -> Result<(), TokenizeError> {
        if patterns.is_empty() {
            return Err(TokenizeError::InvalidPattern {
                pattern: String::new(),
                reason: "`models` is empty: list at least one model or pattern",
            });
        }
        for p in patterns {
            let invalid = |reason| TokenizeError::InvalidPattern {
                pattern: p.clone(),
                reason,
            };
            if p.is_empty() {
                return Err(invalid("empty pattern"));
            }
            if p == "*" {
                if self.wildcard.replace(index).is_some() {
                    return Err(TokenizeError::DuplicatePattern(p.clone()));
                }
                continue;
            }
            match p.find('*') {
                None => {
                    if self.exact.insert(p.clone(), index).is_some() {
                        return Err(TokenizeError::DuplicatePattern(p.clone()));
                    }
                }
                Some(at) if at + 1 == p.len() => {
                    let prefix = &p[..at];
                    if self.prefixes.iter().any(|(q, _)| q == prefix) {
                        return Err(TokenizeError::DuplicatePattern(p.clone()));
                    }
                    self.prefixes.push((prefix.to_owned(), index));
                }
                Some(_) => return Err(invalid("`*` is only allowed at the end")),
            }
        }
        self.prefixes
            .sort_by(|a, b| b.0.len().cmp(&a.0.len()).then_with(|| a.0.cmp(&b.0)));
        Ok(())
    }

    /// The tokenizer index for `model`, if any pattern matches.
    pub(crate) fn lookup(&self, model: &str) -> Option<usize> {
        if let Some(&i) = self.exact.get(model) {
            return Some(i);
        }
        self.prefixes
            .iter()
            .find(|(p, _)| model.starts_with(p.as_str()))
            .map(|&(_, i)| i)
            .or(self.wildcard)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn router(entries: &[&[&str]]) -> Result<Router, TokenizeError> {
        let mut r = Router::default();
        for (i, pats) in entries.iter().enumerate() {
            let pats: Vec<String> = pats.iter().map(|s| (*s).to_owned()).collect();
            r.add(&pats, i)?;
        }
        Ok(r)
    }

    #[test]
    fn precedence_is_exact_then_longest_prefix_then_wildcard() {
        let r = router(&[&["*"], &["gemma*"], &["gemma-3*"], &["gemma-3-270m"]]).expect("valid");
        assert_eq!(r.lookup("gemma-3-270m"), Some(3));
        assert_eq!(r.lookup("gemma-3-1b"), Some(2));
        assert_eq!(r.lookup("gemma-2"), Some(1));
        assert_eq!(r.lookup("llama"), Some(0));
        assert_eq!(r.lookup(""), Some(0));
    }

    #[test]
    fn no_match_without_wildcard() {
        let r = router(&[&["a*", "b"]]).expect("valid");
        assert_eq!(r.lookup("abc"), Some(0));
        assert_eq!(r.lookup("b"), Some(0));
        assert_eq!(r.lookup("bc"), None);
        assert_eq!(r.lookup("A"), None);
    }

    #[test]
    fn bad_patterns_are_rejected() {
        for bad in [&["a*b"][..], &["*a"], &[""], &[]] {
            assert!(
                matches!(router(&[bad]), Err(TokenizeError::InvalidPattern { .. })),
                "{bad:?}"
            );
        }
        assert!(matches!(
            router(&[&["x*"], &["x*"]]),
            Err(TokenizeError::DuplicatePattern(p)) if p == "x*"
        ));
        assert!(matches!(
            router(&[&["*"], &["*"]]),
            Err(TokenizeError::DuplicatePattern(_))
        ));
        assert!(matches!(
            router(&[&["m", "m"]]),
            Err(TokenizeError::DuplicatePattern(_))
        ));
    }
}
