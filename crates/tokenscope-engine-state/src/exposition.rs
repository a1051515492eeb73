//! A small, tolerant parser for the Prometheus text exposition format (0.0.4) and OpenMetrics
//! text (1.0, and the quoted UTF-8 names of Prometheus 3 / OpenMetrics 2).
//!
//! Only samples are kept: `name{labels} value [timestamp]`. Comment lines (`# HELP`, `# TYPE`,
//! `# UNIT`, `# EOF`, anything else after `#`) and blank lines are skipped; OpenMetrics
//! exemplars (` # {…} v [ts]` after the value) are dropped.
//!
//! Invariants:
//! * Parsing never fails as a whole and never panics: a malformed line is skipped and
//!   reported in [`Exposition::errors`] (at most [`MAX_REPORTED_ERRORS`] kept, all counted in
//!   [`Exposition::skipped_lines`]); every well-formed line still yields its sample.
//! * Label values are unescaped (`\\`, `\"`, `\n`); an unknown escape keeps both characters.
//!   Labels keep the order they had on the line; a label with an empty value is kept as written
//!   (Prometheus treats it as absent — [`Sample::label`] returns `None` for it).
//! * Values follow Go's `ParseFloat` spellings the engines use: decimals, exponents, `NaN`,
//!   `+Inf`, `-Inf` (any case).
//! * Histogram/summary series are plain samples here (`_bucket{le=…}`, `_sum`, `_count`), and a
//!   counter's `_created` companion is a separate sample: nothing is merged or renamed.

use std::fmt;

/// How many per-line errors [`parse`] keeps for diagnostics (all are counted).
pub const MAX_REPORTED_ERRORS: usize = 8;

/// One sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    /// Metric name as written (`vllm:num_requests_running`, `x_bucket`, `x_total`, …).
    pub name: String,
    /// Label pairs in the order written, values unescaped.
    pub labels: Vec<(String, String)>,
    /// Sample value.
    pub value: f64,
    /// Timestamp as written (milliseconds in Prometheus text, seconds in OpenMetrics).
    pub timestamp: Option<f64>,
}

impl Sample {
    /// The value of label `key`, if present and non-empty.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, v)| k == key && !v.is_empty())
            .map(|(_, v)| v.as_str())
    }
}

/// Why one line was skipped.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    /// The line has no metric name where one was expected.
    #[error("missing metric name")]
    MissingName,
    /// The label set is malformed (`{…}` unterminated, a pair without `=`, an unquoted value).
    #[error("malformed label set: {0}")]
    Labels(&'static str),
    /// No value after the name/labels.
    #[error("missing value")]
    MissingValue,
    /// The value is not a number.
    #[error("invalid value {0:?}")]
    Value(String),
    /// The timestamp is not a number.
    #[error("invalid timestamp {0:?}")]
    Timestamp(String),
}

/// A skipped line: its 1-based number and the reason.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedLine {
    /// 1-based line number.
    pub line: usize,
    /// Why it was skipped.
    pub error: LineError,
}

impl fmt::Display for SkippedLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.error)
    }
}

/// The result of [`parse`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Exposition {
    /// Every well-formed sample, in document order.
    pub samples: Vec<Sample>,
    /// Number of non-comment, non-blank lines that were skipped as malformed.
    pub skipped_lines: usize,
    /// The first [`MAX_REPORTED_ERRORS`] skipped lines.
    pub errors: Vec<SkippedLine>,
}

impl Exposition {
    /// Samples named exactly `name`.
    pub fn named<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }
}

/// Parses a whole exposition (Prometheus text or OpenMetrics text).
pub fn parse(text: &str) -> Exposition {
    let mut out = Exposition::default();
    for (index, raw) in text.split('\n').enumerate() {
        let line = raw.strip_suffix('\r').unwrap_or(raw).trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match parse_sample_line(line) {
            Ok(sample) => out.samples.push(sample),
            Err(error) => {
                out.skipped_lines += 1;
                if out.errors.len() < MAX_REPORTED_ERRORS {
                    out.errors.push(SkippedLine {
                        line: index + 1,
                        error,
                    });
                }
            }
        }
    }
    out
}

/// Parses one sample line (no comment, already trimmed).
pub fn parse_sample_line(line: &str) -> Result<Sample, LineError> {
    let mut cur = Cursor::new(line);
    let mut name = cur.metric_name();
    let mut labels = Vec::new();
    cur.skip_ws();
    if cur.peek() == Some('{') {
        cur.bump();
        let quoted_name = cur.label_set(&mut labels)?;
        if let Some(quoted) = quoted_name {
            if name.is_some() {
                return Err(LineError::Labels(
                    "metric named both before and inside braces",
                ));
            }
            name = Some(quoted);
        }
    }
    let name = name.ok_or(LineError::MissingName)?;
    cur.skip_ws();
    let value_text = cur.token();
    if value_text.is_empty() {
        return Err(LineError::MissingValue);
    }
    let value = parse_float(value_text).ok_or_else(|| LineError::Value(value_text.to_owned()))?;
    cur.skip_ws();
    let mut timestamp = None;
    if !cur.at_end() && cur.peek() != Some('#') {
        let ts = cur.token();
        timestamp = Some(parse_float(ts).ok_or_else(|| LineError::Timestamp(ts.to_owned()))?);
    }
    // Anything left is an OpenMetrics exemplar (` # {…} v [ts]`) or trailing junk: ignored.
    Ok(Sample {
        name,
        labels,
        value,
        timestamp,
    })
}

/// Go `ParseFloat`-compatible for the spellings exporters use.
fn parse_float(text: &str) -> Option<f64> {
    match text.to_ascii_lowercase().as_str() {
        "nan" | "+nan" | "-nan" => Some(f64::NAN),
        "inf" | "+inf" | "infinity" | "+infinity" => Some(f64::INFINITY),
        "-inf" | "-infinity" => Some(f64::NEG_INFINITY),
        _ => {
            // Rust's parser accepts "inf"/"nan" spellings handled above and nothing exotic
            // beyond; reject an empty or sign-only token explicitly.
            text.parse::<f64>().ok()
        }
    }
}

fn is_name_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':'
}

fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == ':'
}

struct Cursor<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn new(text: &'a str) -> Self {
        Self { text, pos: 0 }
    }

    fn rest(&self) -> &'a str {
        self.text.get(self.pos..).unwrap_or("")
    }

    fn peek(&self) -> Option<char> {
        self.rest().chars().next()
    }

    fn bump(&mut self) -> Option<char> {
        let c = self.peek()?;
        self.pos += c.len_utf8();
        Some(c)
    }

    fn at_end(&self) -> bool {
        self.pos >= self.text.len()
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(' ' | '\t')) {
            self.bump();
        }
    }

    /// A run of non-whitespace characters.
    fn token(&mut self) -> &'a str {
        let start = self.pos;
        while matches!(self.peek(), Some(c) if c != ' ' && c != '\t') {
            self.bump();
        }
        self.text.get(start..self.pos).unwrap_or("")
    }

    /// A bare metric name at the start of the line, if any.
    fn metric_name(&mut self) -> Option<String> {
        self.identifier()
    }

    fn identifier(&mut self) -> Option<String> {
        let start = self.pos;
        match self.peek() {
            Some(c) if is_name_start(c) => {
                self.bump();
            }
            _ => return None,
        }
        while matches!(self.peek(), Some(c) if is_name_char(c)) {
            self.bump();
        }
        self.text.get(start..self.pos).map(str::to_owned)
    }

    /// A double-quoted string with `\\`, `\"`, `\n` escapes; the opening quote is next.
    fn quoted(&mut self) -> Result<String, LineError> {
        if self.bump() != Some('"') {
            return Err(LineError::Labels("expected '\"'"));
        }
        let mut out = String::new();
        loop {
            match self.bump() {
                None => return Err(LineError::Labels("unterminated quoted string")),
                Some('"') => return Ok(out),
                Some('\\') => match self.bump() {
                    Some('\\') => out.push('\\'),
                    Some('"') => out.push('"'),
                    Some('n') => out.push('\n'),
                    Some(other) => {
                        out.push('\\');
                        out.push(other);
                    }
                    None => return Err(LineError::Labels("unterminated escape")),
                },
                Some(c) => out.push(c),
            }
        }
    }

    /// The inside of `{…}` after the opening brace, through the closing one. Returns the
    /// metric name when it is given inside the braces as a lone quoted string (UTF-8 names).
    fn label_set(
        &mut self,
        labels: &mut Vec<(String, String)>,
    ) -> Result<Option<String>, LineError> {
        let mut quoted_name = None;
        loop {
            self.skip_ws();
            match self.peek() {
                None => return Err(LineError::Labels("unterminated '{'")),
                Some('}') => {
                    self.bump();
                    return Ok(quoted_name);
                }
                _ => {}
            }
            let key = if self.peek() == Some('"') {
                let text = self.quoted()?;
                self.skip_ws();
                if matches!(self.peek(), Some(',' | '}')) {
                    // A lone quoted string: the metric name (Prometheus 3 UTF-8 syntax).
                    if quoted_name.is_some() {
                        return Err(LineError::Labels("two quoted metric names"));
                    }
                    quoted_name = Some(text);
                    if self.peek() == Some(',') {
                        self.bump();
                    }
                    continue;
                }
                text
            } else {
                self.identifier()
                    .ok_or(LineError::Labels("expected a label name"))?
            };
            self.skip_ws();
            if self.bump() != Some('=') {
                return Err(LineError::Labels("expected '=' after a label name"));
            }
            self.skip_ws();
            let value = self.quoted()?;
            labels.push((key, value));
            self.skip_ws();
            match self.peek() {
                Some(',') => {
                    self.bump();
                }
                Some('}') => {}
                None => return Err(LineError::Labels("unterminated '{'")),
                Some(_) => return Err(LineError::Labels("expected ',' or '}'")),
            }
        }
    }
}

/// Renders one sample in Prometheus text format (used by tests and tools; escapes label
/// values so that [`parse`] reads them back exactly).
pub fn render_sample(sample: &Sample) -> String {
    let mut out = sample.name.clone();
    if !sample.labels.is_empty() {
        out.push('{');
        for (i, (k, v)) in sample.labels.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(k);
            out.push_str("=\"");
            for c in v.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '"' => out.push_str("\\\""),
                    '\n' => out.push_str("\\n"),
                    c => out.push(c),
                }
            }
            out.push('"');
        }
        out.push('}');
    }
    out.push(' ');
    out.push_str(&render_float(sample.value));
    if let Some(ts) = sample.timestamp {
        out.push(' ');
        out.push_str(&render_float(ts));
    }
    out
}

fn render_float(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_owned()
    } else if v == f64::INFINITY {
        "+Inf".to_owned()
    } else if v == f64::NEG_INFINITY {
        "-Inf".to_owned()
    } else {
        format!("{v:?}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn one(line: &str) -> Sample {
        parse_sample_line(line).expect("line parses")
    }

    #[test]
    fn plain_and_labelled_samples() {
        let s = one("tgi_queue_size 7");
        assert_eq!(s.name, "tgi_queue_size");
        assert!(s.labels.is_empty());
        assert_eq!(s.value, 7.0);
        assert_eq!(s.timestamp, None);

        let s = one(r#"vllm:num_requests_running{engine="0",model_name="m/x"} 3.0"#);
        assert_eq!(s.name, "vllm:num_requests_running");
        assert_eq!(
            s.labels,
            vec![
                ("engine".to_owned(), "0".to_owned()),
                ("model_name".to_owned(), "m/x".to_owned())
            ]
        );
        assert_eq!(s.value, 3.0);
        assert_eq!(s.label("engine"), Some("0"));
        assert_eq!(s.label("missing"), None);
    }

    #[test]
    fn special_values_timestamps_and_exemplars() {
        assert!(one("x NaN").value.is_nan());
        assert_eq!(one("x +Inf").value, f64::INFINITY);
        assert_eq!(one("x -Inf").value, f64::NEG_INFINITY);
        let expected: f64 = "1776930173.6864316".parse().expect("float literal");
        assert_eq!(one("x 1.7769301736864316e+09").value, expected);
        let s = one(r#"x{le="+Inf"} 4 1790347303000"#);
        assert_eq!(s.timestamp, Some(1_790_347_303_000.0));
        assert_eq!(s.label("le"), Some("+Inf"));
        let s = one(r#"foo_bucket{le="0.5"} 3 # {trace_id="abc"} 0.4 1.5e9"#);
        assert_eq!(s.value, 3.0);
        assert_eq!(s.timestamp, None);
        let s = one(r#"foo_total 17.0 1520879607.789 # {id="x"} 1"#);
        assert_eq!(s.timestamp, Some(1_520_879_607.789));
    }

    #[test]
    fn escapes_whitespace_and_trailing_comma() {
        let s = one(r#"m { a = "x\"y\\z\nw" , b="", } 1"#);
        assert_eq!(s.labels[0], ("a".to_owned(), "x\"y\\z\nw".to_owned()));
        assert_eq!(s.labels[1], ("b".to_owned(), String::new()));
        assert_eq!(s.label("b"), None, "empty label value reads as absent");
        assert_eq!(s.value, 1.0);
        let s = one(r#"m{a="\q"} 2"#);
        assert_eq!(s.labels[0].1, "\\q", "unknown escape kept as written");
    }

    #[test]
    fn utf8_quoted_names() {
        let s = one(r#"{"gen_ai.client.token.usage", "gen_ai.token.type"="input", job="x"} 5"#);
        assert_eq!(s.name, "gen_ai.client.token.usage");
        assert_eq!(s.label("gen_ai.token.type"), Some("input"));
        assert_eq!(s.label("job"), Some("x"));
        assert_eq!(s.value, 5.0);
    }

    #[test]
    fn malformed_lines_are_skipped_and_reported() {
        let text = "good 1\nbad{a=\"1\" 2\n\n# HELP x y\nnovalue\nv{a=1} 3\nx abc\ny 1 zz\nlast 2\r\n# EOF\n";
        let e = parse(text);
        let names: Vec<&str> = e.samples.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, vec!["good", "last"]);
        assert_eq!(e.skipped_lines, 5);
        assert_eq!(e.errors.len(), 5);
        assert_eq!(e.errors[0].line, 2);
        assert_eq!(e.errors[1].error, LineError::MissingValue);
        assert_eq!(e.errors[1].line, 5);
        assert_eq!(e.errors[3].error, LineError::Value("abc".to_owned()));
        assert_eq!(e.errors[4].error, LineError::Timestamp("zz".to_owned()));
    }

    #[test]
    fn openmetrics_document() {
        let text = "# TYPE vllm:prefix_cache_hits counter\n# HELP vllm:prefix_cache_hits Prefix cache hits.\nvllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 12.0\nvllm:prefix_cache_hits_created{engine=\"0\",model_name=\"m\"} 1.7e+09\n# EOF\n";
        let e = parse(text);
        assert_eq!(e.skipped_lines, 0);
        assert_eq!(e.samples.len(), 2);
        assert_eq!(e.named("vllm:prefix_cache_hits_total").count(), 1);
        assert_eq!(e.samples[1].name, "vllm:prefix_cache_hits_created");
    }

    fn label_value() -> impl Strategy<Value = String> {
        proptest::collection::vec(
            prop_oneof![
                Just('\\'),
                Just('"'),
                Just('\n'),
                Just(' '),
                Just(','),
                Just('}'),
                Just('{'),
                Just('='),
                Just('#'),
                any::<char>(),
            ],
            0..12,
        )
        .prop_map(|cs| cs.into_iter().collect())
    }

    fn sample() -> impl Strategy<Value = Sample> {
        (
            "[a-zA-Z_:][a-zA-Z0-9_:]{0,20}",
            proptest::collection::vec(("[a-zA-Z_][a-zA-Z0-9_]{0,10}", label_value()), 0..5),
            prop_oneof![
                any::<f64>(),
                Just(f64::INFINITY),
                Just(f64::NEG_INFINITY),
                (-1.0e6f64..1.0e6)
            ],
            proptest::option::of(0i64..4_000_000_000_000),
        )
            .prop_map(|(name, labels, value, ts)| Sample {
                name,
                labels,
                value,
                timestamp: ts.map(|t| t as f64),
            })
    }

    fn same(a: &Sample, b: &Sample) -> bool {
        a.name == b.name
            && a.labels == b.labels
            && a.timestamp == b.timestamp
            && (a.value == b.value || (a.value.is_nan() && b.value.is_nan()))
    }

    proptest! {
        #[test]
        fn rendered_samples_parse_back(samples in proptest::collection::vec(sample(), 0..20)) {
            let text: String = samples
                .iter()
                .map(|s| format!("# HELP {} some help\n{}\n", s.name, render_sample(s)))
                .collect();
            let parsed = parse(&text);
            prop_assert_eq!(parsed.skipped_lines, 0);
            prop_assert_eq!(parsed.samples.len(), samples.len());
            for (a, b) in samples.iter().zip(parsed.samples.iter()) {
                prop_assert!(same(a, b), "{:?} != {:?}", a, b);
            }
        }

        #[test]
        fn arbitrary_input_never_panics(text in any::<String>()) {
            let parsed = parse(&text);
            prop_assert!(parsed.errors.len() <= MAX_REPORTED_ERRORS);
            prop_assert!(parsed.errors.len() <= parsed.skipped_lines);
        }

        #[test]
        fn junk_lines_do_not_hide_good_ones(
            good in proptest::collection::vec(sample(), 1..10),
            junk in proptest::collection::vec("[^\n#]{1,30}", 0..10),
        ) {
            let mut text = String::new();
            for (i, s) in good.iter().enumerate() {
                text.push_str(&render_sample(s));
                text.push('\n');
                if let Some(j) = junk.get(i) {
                    text.push_str(j);
                    text.push('\n');
                }
            }
            let parsed = parse(&text);
            let kept: Vec<&Sample> = parsed
                .samples
                .iter()
                .filter(|p| good.iter().any(|g| same(g, p)))
                .collect();
            prop_assert!(kept.len() >= good.len());
        }
    }
}
