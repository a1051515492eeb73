//! Credentials out of URLs before they are logged or shown, and the strict `%XX` decoding of
//! URL parts and header values ([`percent_decode`]).
//!
//! Invariants: [`redact_url`] never returns the password of a `scheme://user:password@host…`
//! URL; everything else (scheme, user, host, path, query) is kept as given.
//! [`percent_decode`] refuses a malformed escape or bytes that are not UTF-8 (`None`) rather
//! than passing them through.

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

/// `%XX` escapes decoded (`+` is kept: not form encoding); `None` for a truncated or non-hex
/// escape, or a result that is not UTF-8.
pub fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' {
            let hex = std::str::from_utf8(b.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
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

    #[test]
    fn percent_decode_is_strict() {
        assert_eq!(super::percent_decode("a%20b+c").as_deref(), Some("a b+c"));
        assert_eq!(super::percent_decode("%E2%82%AC").as_deref(), Some("€"));
        assert_eq!(super::percent_decode("50%"), None);
        assert_eq!(super::percent_decode("%zz"), None);
        assert_eq!(super::percent_decode("%ff"), None);
    }
}
