//! Layering: the TOML file and the `TOKENSCOPE_*` environment merged into one tree, then
//! deserialized into the schema with serde, every value remembering where it came from.
//!
//! * The file is parsed into a tree whose tables stay tables (so the environment can set one
//!   key inside them) and whose other values are TOML values.
//! * `TOKENSCOPE_A__B__C=v` sets key `a.b.c` (lowercased), at any depth. A variable belongs to
//!   the configuration when its first segment names a top-level key of the schema; that list
//!   is read from the schema itself ([`top_level_keys`], serde's field list), not kept by
//!   hand. Other `TOKENSCOPE_*` variables belong to scripts and to the command line's own
//!   options and are ignored.
//! * An environment value is text until a field reads it: a string field takes it as it is
//!   (`TOKENSCOPE_DASHBOARD__TOKEN=123456` is the string `"123456"`), a number or boolean
//!   field parses it, an array or table field reads it as an inline TOML value
//!   (`["a", "b"]`, `{ k = "v" }`), and a field that accepts several types (a duration: an
//!   integer of milliseconds or a text with a unit) reads it as an integer, a float, a
//!   boolean or else a string, in that order.
//!
//! Invariants:
//! * Precedence is defaults (`#[serde(default)]`) → file → environment: a value from the
//!   environment replaces the file's at the same key; tables merge key by key.
//! * A key that names no setting is an error, from the file (`deny_unknown_fields`) and from
//!   the environment alike (also below a table that ignores unknown keys).
//! * Every error names the dotted key and its source: the file's path or the variable.

use serde::de::{self, DeserializeOwned, DeserializeSeed, IntoDeserializer, MapAccess, Visitor};
use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

/// The prefix of the variables the configuration reads.
pub const ENV_PREFIX: &str = "TOKENSCOPE_";

/// Where a value came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Built-in default.
    Default,
    /// The configuration file.
    File(String),
    /// An environment variable.
    Env(String),
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Default => f.write_str("the defaults"),
            Origin::File(p) => write!(f, "file {p}"),
            Origin::Env(v) => write!(f, "environment variable {v}"),
        }
    }
}

/// A node of the merged tree.
#[derive(Debug, Clone)]
enum Node {
    /// A non-table value from the file.
    File(toml::Value),
    /// An environment value: text, typed by the field that reads it.
    Env(String),
    /// A table, from the file, the environment or both.
    Table(BTreeMap<String, Entry>),
}

#[derive(Debug, Clone)]
struct Entry {
    node: Node,
    origin: Origin,
}

impl Node {
    fn from_toml(v: toml::Value, origin: &Origin) -> Node {
        match v {
            toml::Value::Table(t) => Node::Table(
                t.into_iter()
                    .map(|(k, v)| {
                        let node = Node::from_toml(v, origin);
                        (
                            k,
                            Entry {
                                node,
                                origin: origin.clone(),
                            },
                        )
                    })
                    .collect(),
            ),
            v => Node::File(v),
        }
    }

    fn has_env(&self) -> bool {
        match self {
            Node::Env(_) => true,
            Node::File(_) => false,
            Node::Table(t) => t.values().any(|e| e.node.has_env()),
        }
    }
}

/// An error with the key and source it belongs to (set once, at the innermost key).
#[derive(Debug)]
pub struct LayerError {
    /// The message.
    pub message: String,
    /// Dotted key and its source, once known.
    pub at: Option<(String, Origin)>,
}

impl fmt::Display for LayerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.at {
            Some((key, origin)) => write!(f, "`{key}` (from {origin}): {}", self.message),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for LayerError {}

impl de::Error for LayerError {
    fn custom<T: fmt::Display>(msg: T) -> Self {
        LayerError {
            message: msg.to_string(),
            at: None,
        }
    }
}

impl LayerError {
    fn locate(mut self, key: &str, origin: &Origin) -> Self {
        if self.at.is_none() {
            self.at = Some((key.to_owned(), origin.clone()));
        }
        self
    }
}

/// The configuration sources, merged: build with [`Layers::file`] and [`Layers::env`], read
/// with [`Layers::extract`].
#[derive(Debug, Clone, Default)]
pub struct Layers {
    root: BTreeMap<String, Entry>,
}

impl Layers {
    /// Adds a parsed TOML document from `path` (its values replace earlier ones).
    pub fn file(mut self, path: &Path, doc: toml::Table) -> Self {
        let origin = Origin::File(path.display().to_string());
        if let Node::Table(t) = Node::from_toml(toml::Value::Table(doc), &origin) {
            merge(&mut self.root, t);
        }
        self
    }

    /// Adds the variables `TOKENSCOPE_<KEY>[__<KEY>…]` whose first key is one of `owned`;
    /// other variables are ignored.
    pub fn env(mut self, vars: impl IntoIterator<Item = (String, String)>, owned: &[&str]) -> Self {
        for (var, value) in vars {
            let Some(rest) = var.strip_prefix(ENV_PREFIX) else {
                continue;
            };
            let path: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
            if !path.first().is_some_and(|k| owned.contains(&k.as_str())) {
                continue;
            }
            let origin = Origin::Env(var.clone());
            set(&mut self.root, &path, Node::Env(value), &origin);
        }
        self
    }

    /// Adds the settings of the OpenTelemetry exporter variables ([`crate::otel::settings`]),
    /// in their order: a later one replaces an earlier one at the same key, and the
    /// `TOKENSCOPE_*` environment added after them replaces both.
    pub fn otel(mut self, settings: Vec<crate::otel::OtelSetting>) -> Self {
        for s in settings {
            let origin = Origin::Env(s.var);
            set(&mut self.root, &s.path, Node::Env(s.value), &origin);
        }
        self
    }

    /// Deserializes the merged tree into `T` (missing keys: `T`'s serde defaults).
    pub fn extract<T: DeserializeOwned>(&self) -> Result<T, LayerError> {
        T::deserialize(NodeDe {
            node: NodeRef::Root(&self.root),
            path: String::new(),
        })
    }
}

fn merge(into: &mut BTreeMap<String, Entry>, from: BTreeMap<String, Entry>) {
    for (k, e) in from {
        match (into.get_mut(&k), e.node) {
            (
                Some(Entry {
                    node: Node::Table(old),
                    ..
                }),
                Node::Table(new),
            ) => merge(old, new),
            (_, node) => {
                into.insert(
                    k,
                    Entry {
                        node,
                        origin: e.origin,
                    },
                );
            }
        }
    }
}

fn set(table: &mut BTreeMap<String, Entry>, path: &[String], node: Node, origin: &Origin) {
    let Some((first, rest)) = path.split_first() else {
        return;
    };
    if rest.is_empty() {
        table.insert(
            first.clone(),
            Entry {
                node,
                origin: origin.clone(),
            },
        );
        return;
    }
    let entry = table.entry(first.clone()).or_insert_with(|| Entry {
        node: Node::Table(BTreeMap::new()),
        origin: origin.clone(),
    });
    if !matches!(entry.node, Node::Table(_)) {
        // A table set below a value: the variable's key decides (and the schema then says
        // whether a table is allowed there).
        *entry = Entry {
            node: Node::Table(BTreeMap::new()),
            origin: origin.clone(),
        };
    }
    if let Node::Table(t) = &mut entry.node {
        set(t, rest, node, origin);
    }
}

/// The top-level keys of `T`'s schema (its serde field names).
pub fn top_level_keys<T: DeserializeOwned>() -> &'static [&'static str] {
    match T::deserialize(FieldProbe) {
        Err(ProbeError(Some(fields))) => fields,
        _ => &[],
    }
}

#[derive(Debug)]
struct ProbeError(Option<&'static [&'static str]>);

impl fmt::Display for ProbeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("schema probe")
    }
}

impl std::error::Error for ProbeError {}

impl de::Error for ProbeError {
    fn custom<T: fmt::Display>(_: T) -> Self {
        ProbeError(None)
    }
}

/// A deserializer that only records the field list a struct asks for.
struct FieldProbe;

impl<'de> de::Deserializer<'de> for FieldProbe {
    type Error = ProbeError;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, ProbeError> {
        Err(ProbeError(None))
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, ProbeError> {
        Err(ProbeError(Some(fields)))
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        option unit unit_struct newtype_struct seq tuple tuple_struct map enum identifier
        ignored_any
    }
}

#[derive(Clone, Copy)]
enum NodeRef<'a> {
    Root(&'a BTreeMap<String, Entry>),
    Node(&'a Node),
}

struct NodeDe<'a> {
    node: NodeRef<'a>,
    path: String,
}

impl<'a> NodeDe<'a> {
    fn node(&self) -> Option<&'a Node> {
        match self.node {
            NodeRef::Node(n) => Some(n),
            NodeRef::Root(_) => None,
        }
    }

    fn table(&self) -> Option<&'a BTreeMap<String, Entry>> {
        match self.node {
            NodeRef::Root(t) | NodeRef::Node(Node::Table(t)) => Some(t),
            NodeRef::Node(_) => None,
        }
    }

    fn text(&self) -> Option<&'a str> {
        match self.node {
            NodeRef::Node(Node::Env(s)) => Some(s),
            _ => None,
        }
    }
}

fn toml_err(e: toml::de::Error) -> LayerError {
    LayerError {
        message: e.message().trim().to_owned(),
        at: None,
    }
}

/// An environment text read as an inline TOML value (for arrays and tables).
fn inline_toml(text: &str, what: &str) -> Result<toml::Value, LayerError> {
    let doc: toml::Table = format!("v = {text}")
        .parse()
        .map_err(|_| de::Error::custom(format!("expected {what} written in TOML, got {text:?}")))?;
    doc.get("v")
        .cloned()
        .ok_or_else(|| de::Error::custom(format!("expected {what}, got {text:?}")))
}

/// Forwards `deserialize_$m` to the TOML value of a file leaf.
macro_rules! leaf {
    ($self:ident, $v:ident, $m:ident $(, $arg:expr)*) => {
        if let Some(Node::File(val)) = $self.node() {
            return de::Deserializer::$m(val.clone() $(, $arg)*, $v).map_err(toml_err);
        }
    };
}

macro_rules! number {
    ($($m:ident $t:ty => $visit:ident),* $(,)?) => {$(
        fn $m<V: Visitor<'de>>(self, v: V) -> Result<V::Value, LayerError> {
            leaf!(self, v, $m);
            match self.text() {
                Some(t) => match t.trim().parse::<$t>() {
                    Ok(n) => v.$visit(n),
                    Err(e) => Err(de::Error::custom(format!(
                        "{t:?} is not a {} ({e})",
                        stringify!($t)
                    ))),
                },
                None => self.deserialize_any(v),
            }
        }
    )*};
}

impl<'de, 'a> de::Deserializer<'de> for NodeDe<'a> {
    type Error = LayerError;

    fn deserialize_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, LayerError> {
        leaf!(self, v, deserialize_any);
        if let Some(t) = self.text() {
            // A field of several types: the first reading that fits.
            let t = t.trim();
            if let Ok(i) = t.parse::<i64>() {
                return v.visit_i64(i);
            }
            if let Ok(f) = t.parse::<f64>() {
                return v.visit_f64(f);
            }
            return match t {
                "true" => v.visit_bool(true),
                "false" => v.visit_bool(false),
                _ => v.visit_str(t),
            };
        }
        match self.table() {
            Some(t) => v.visit_map(TableAccess::new(t, self.path)),
            None => Err(de::Error::custom("unreadable value")),
        }
    }

    fn deserialize_bool<V: Visitor<'de>>(self, v: V) -> Result<V::Value, LayerError> {
        leaf!(self, v, deserialize_bool);
        match self.text().map(str::trim) {
            Some("true") => v.visit_bool(true),
            Some("false") => v.visit_bool(false),
            Some(t) => Err(de::Error::custom(format!(
                "{t:?} is not a boolean (true or false)"
            ))),
            None => self.deserialize_any(v),
        }
    }

    number! {
        deserialize_i8 i8 => visit_i8,
        deserialize_i16 i16 => visit_i16,
        deserialize_i32 i32 => visit_i32,
        deserialize_i64 i64 => visit_i64,
        deserialize_u8 u8 => visit_u8,
        deserialize_u16 u16 => visit_u16,
        deserialize_u32 u32 => visit_u32,
        deserialize_u64 u64 => visit_u64,
        deserialize_f32 f32 => visit_f32,
        deserialize_f64 f64 => visit_f64,
    }

    fn deserialize_str<V: Visitor<'de>>(self, v: V) -> Result<V::Value, LayerError> {
        leaf!(self, v, deserialize_str);
        match self.text() {
            Some(t) => v.visit_str(t),
            None => self.deserialize_any(v),
        }
    }

    fn deserialize_string<V: Visitor<'de>>(self, v: V) -> Result<V::Value, LayerError> {
        self.deserialize_str(v)
    }

    fn deserialize_char<V: Visitor<'de>>(self, v: V) -> Result<V::Value, LayerError> {
        self.deserialize_str(v)
    }

    fn deserialize_identifier<V: Visitor<'de>>(self, v: V) -> Result<V::Value, LayerError> {
        self.deserialize_str(v)
    }

    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, LayerError> {
        leaf!(self, v, deserialize_option);
        v.visit_some(self)
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        v: V,
    ) -> Result<V::Value, LayerError> {
        leaf!(self, v, deserialize_newtype_struct, name);
        v.visit_newtype_struct(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, LayerError> {
        leaf!(self, v, deserialize_enum, name, variants);
        match self.text() {
            Some(t) => v.visit_enum(t.trim().into_deserializer()),
            None => self.deserialize_any(v),
        }
    }

    fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value, LayerError> {
        leaf!(self, v, deserialize_seq);
        match self.text() {
            Some(t) => {
                de::Deserializer::deserialize_seq(inline_toml(t, "an array")?, v).map_err(toml_err)
            }
            None => self.deserialize_any(v),
        }
    }

    fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, LayerError> {
        leaf!(self, v, deserialize_map);
        match self.text() {
            Some(t) => {
                de::Deserializer::deserialize_map(inline_toml(t, "a table")?, v).map_err(toml_err)
            }
            None => self.deserialize_any(v),
        }
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, LayerError> {
        leaf!(self, v, deserialize_struct, name, fields);
        match self.text() {
            Some(t) => {
                de::Deserializer::deserialize_struct(inline_toml(t, "a table")?, name, fields, v)
                    .map_err(toml_err)
            }
            None => self.deserialize_any(v),
        }
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, v: V) -> Result<V::Value, LayerError> {
        // A key the schema does not read: an error when the environment set it (a typo must
        // not be silently ignored); the file's are the schema's business.
        let from_env = match self.node {
            NodeRef::Root(t) => t.values().any(|e| e.node.has_env()),
            NodeRef::Node(n) => n.has_env(),
        };
        if from_env {
            return Err(de::Error::custom("no such setting"));
        }
        v.visit_unit()
    }

    serde::forward_to_deserialize_any! {
        i128 u128 bytes byte_buf unit unit_struct tuple tuple_struct
    }
}

struct TableAccess<'a> {
    iter: std::collections::btree_map::Iter<'a, String, Entry>,
    current: Option<(String, &'a Entry)>,
    path: String,
}

impl<'a> TableAccess<'a> {
    fn new(t: &'a BTreeMap<String, Entry>, path: String) -> Self {
        TableAccess {
            iter: t.iter(),
            current: None,
            path,
        }
    }
}

impl<'de, 'a> MapAccess<'de> for TableAccess<'a> {
    type Error = LayerError;

    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, LayerError> {
        let Some((k, entry)) = self.iter.next() else {
            return Ok(None);
        };
        let key = if self.path.is_empty() {
            k.clone()
        } else {
            format!("{}.{k}", self.path)
        };
        let out = seed
            .deserialize(de::value::StrDeserializer::<LayerError>::new(k))
            .map_err(|e| e.locate(&key, &entry.origin))?;
        self.current = Some((key, entry));
        Ok(Some(out))
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(
        &mut self,
        seed: S,
    ) -> Result<S::Value, LayerError> {
        let Some((key, entry)) = self.current.take() else {
            return Err(de::Error::custom("a value without a key"));
        };
        seed.deserialize(NodeDe {
            node: NodeRef::Node(&entry.node),
            path: key.clone(),
        })
        .map_err(|e| e.locate(&key, &entry.origin))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    /// A schema that ignores unknown keys (no `deny_unknown_fields`).
    #[derive(Debug, Deserialize, Default, PartialEq)]
    #[serde(default)]
    struct Lenient {
        name: String,
        inner: Inner,
    }

    #[derive(Debug, Deserialize, Default, PartialEq)]
    #[serde(default)]
    struct Inner {
        n: u32,
        list: Vec<u32>,
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    #[test]
    fn keys_are_read_from_the_schema() {
        assert_eq!(top_level_keys::<Lenient>(), ["name", "inner"]);
        assert_eq!(top_level_keys::<Inner>(), ["n", "list"]);
    }

    #[test]
    fn env_text_is_typed_by_the_field_and_unknown_env_keys_fail_everywhere() {
        let owned = top_level_keys::<Lenient>();
        let doc: toml::Table = "name = \"file\"\n[inner]\nn = 1\nfuture = true\n"
            .parse()
            .expect("toml");
        let got: Lenient = Layers::default()
            .file(Path::new("f.toml"), doc.clone())
            .env(
                env(&[
                    ("TOKENSCOPE_NAME", "007"),
                    ("TOKENSCOPE_INNER__LIST", "[1, 2]"),
                    ("TOKENSCOPE_OTHER", "x"),
                    ("UNRELATED", "y"),
                ]),
                owned,
            )
            .extract()
            .expect("valid");
        assert_eq!(
            got,
            Lenient {
                name: "007".into(),
                inner: Inner {
                    n: 1,
                    list: vec![1, 2],
                },
            }
        );
        // The file's unknown key is the schema's business (this one ignores it); the
        // environment's is an error naming the variable.
        let err = Layers::default()
            .file(Path::new("f.toml"), doc)
            .env(env(&[("TOKENSCOPE_INNER__TYPO", "1")]), owned)
            .extract::<Lenient>()
            .expect_err("typo");
        assert_eq!(
            err.at,
            Some((
                "inner.typo".into(),
                Origin::Env("TOKENSCOPE_INNER__TYPO".into())
            ))
        );
        let err = Layers::default()
            .env(env(&[("TOKENSCOPE_INNER__N", "-1")]), owned)
            .extract::<Lenient>()
            .expect_err("negative");
        assert!(
            err.to_string().starts_with(
                "`inner.n` (from environment variable TOKENSCOPE_INNER__N): \"-1\" is not a u32"
            ),
            "{err}"
        );
    }
}
