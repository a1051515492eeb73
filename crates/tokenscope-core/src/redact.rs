//! Credentials out of URLs before they are logged or shown.
//!
//! Invariant: [`redact_url`] never returns the password of a `scheme://user:password@host…`
//! URL; everything else (scheme, user, host, path, query) is kept as given.

/// `scheme://user:secret@host…` → `scheme://user:***@host…` (never log a password).
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let (auth_end, _) = rest
        .char_indices()
        .find(|(_, c)| *c == '/' || *c == '?')
        .unwrap_or((rest.len(), ' '));
    match rest[..auth_end].rfind('@') {
        Some(at) => {
            let user = rest[..at].split(':').next().unwrap_or("");
            format!("{scheme}://{user}:***@{}", &rest[at + 1..])
        }
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn hides_the_password_only() {
        assert_eq!(
            redact_url("clickhouse://u:secret@h:8123/db?x=1"),
            "clickhouse://u:***@h:8123/db?x=1"
        );
        assert_eq!(redact_url("http://h:1/p@q"), "http://h:1/p@q");
        assert_eq!(redact_url("http://u@h/"), "http://u:***@h/");
        assert_eq!(redact_url("./tokenscope.db"), "./tokenscope.db");
    }
}
