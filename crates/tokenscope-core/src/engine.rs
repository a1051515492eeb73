//! The inference engines tokenscope knows, and the kind an upstream is configured with.
//!
//! * [`Engine`] — an engine whose metrics and response extras tokenscope reads (vLLM, SGLang,
//!   llama.cpp, TGI).
//! * [`EngineKind`] — the `kind` of an `[[upstreams]]` entry: `auto` (detect), one engine, or
//!   `openai` (any other OpenAI-compatible server).
//!
//! Invariants:
//! * Names are stable: they are the configuration syntax (`kind = "llamacpp"`) and the values
//!   of the stored `engine` column (`llamacpp`, `vllm`, `tgi`, `sglang`, `openai`).
//! * Parsing is case-insensitive and also accepts `llama.cpp` / `llama-cpp`; serde reads and
//!   writes the same names as [`std::str::FromStr`] / [`std::fmt::Display`].

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;
use std::str::FromStr;

/// An inference engine tokenscope can read state and per-request phases from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Engine {
    /// vLLM.
    Vllm,
    /// SGLang.
    Sglang,
    /// llama.cpp's `llama-server`.
    LlamaCpp,
    /// Hugging Face text-generation-inference.
    Tgi,
}

impl Engine {
    /// All engines, in the order that breaks ties when detecting one from its metric names.
    pub const ALL: [Engine; 4] = [Engine::Vllm, Engine::Sglang, Engine::LlamaCpp, Engine::Tgi];

    /// Stable name (`vllm`, `sglang`, `llamacpp`, `tgi`).
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
            Engine::LlamaCpp => "llamacpp",
            Engine::Tgi => "tgi",
        }
    }
}

/// The configured kind of an upstream (`auto|llamacpp|vllm|tgi|sglang|openai`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum EngineKind {
    /// Detect from what the engine sends (metric names, response extras).
    #[default]
    Auto,
    /// This engine: read its names only, trust it.
    Engine(Engine),
    /// An opaque OpenAI-compatible API: usage only, no engine metrics expected.
    OpenAi,
}

impl EngineKind {
    /// Every kind, in the order of the error message and the docs.
    pub const ALL: [EngineKind; 6] = [
        EngineKind::Auto,
        EngineKind::Engine(Engine::LlamaCpp),
        EngineKind::Engine(Engine::Vllm),
        EngineKind::Engine(Engine::Tgi),
        EngineKind::Engine(Engine::Sglang),
        EngineKind::OpenAi,
    ];

    /// The configuration name (`auto`, `llamacpp`, …, `openai`).
    pub fn as_str(self) -> &'static str {
        match self {
            EngineKind::Auto => "auto",
            EngineKind::Engine(e) => e.as_str(),
            EngineKind::OpenAi => "openai",
        }
    }

    /// The name stored in the `engine` column (`None` for `auto`: the record then says what
    /// was detected).
    pub fn name(self) -> Option<&'static str> {
        match self {
            EngineKind::Auto => None,
            k => Some(k.as_str()),
        }
    }

    /// The engine, when one is configured.
    pub fn engine(self) -> Option<Engine> {
        match self {
            EngineKind::Engine(e) => Some(e),
            EngineKind::Auto | EngineKind::OpenAi => None,
        }
    }
}

/// An unrecognised engine or kind name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown engine kind {0:?} (expected auto, llamacpp, vllm, tgi, sglang or openai)")]
pub struct UnknownKind(pub String);

impl FromStr for EngineKind {
    type Err = UnknownKind;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => EngineKind::Auto,
            "vllm" => EngineKind::Engine(Engine::Vllm),
            "sglang" => EngineKind::Engine(Engine::Sglang),
            "llamacpp" | "llama.cpp" | "llama-cpp" => EngineKind::Engine(Engine::LlamaCpp),
            "tgi" => EngineKind::Engine(Engine::Tgi),
            "openai" => EngineKind::OpenAi,
            _ => return Err(UnknownKind(s.to_owned())),
        })
    }
}

impl FromStr for Engine {
    type Err = UnknownKind;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        s.parse::<EngineKind>()?
            .engine()
            .ok_or_else(|| UnknownKind(s.to_owned()))
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for EngineKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

macro_rules! serde_by_name {
    ($t:ty) => {
        impl Serialize for $t {
            fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.serialize_str(self.as_str())
            }
        }

        impl<'de> Deserialize<'de> for $t {
            fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
                let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
                s.parse().map_err(serde::de::Error::custom)
            }
        }
    };
}
serde_by_name!(Engine);
serde_by_name!(EngineKind);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for k in EngineKind::ALL {
            assert_eq!(k.as_str().parse::<EngineKind>(), Ok(k));
            let json = serde_json::to_string(&k).expect("json");
            assert_eq!(json, format!("\"{}\"", k.as_str()));
            assert_eq!(serde_json::from_str::<EngineKind>(&json).expect("back"), k);
        }
        for e in Engine::ALL {
            assert_eq!(e.as_str().parse::<Engine>(), Ok(e));
            assert_eq!(EngineKind::Engine(e).name(), Some(e.as_str()));
        }
        assert_eq!(EngineKind::Auto.name(), None);
        assert_eq!(EngineKind::OpenAi.name(), Some("openai"));
        assert_eq!(EngineKind::default(), EngineKind::Auto);
    }

    #[test]
    fn kind_names() {
        assert_eq!("auto".parse::<EngineKind>(), Ok(EngineKind::Auto));
        assert_eq!(
            "llamacpp".parse::<EngineKind>(),
            Ok(EngineKind::Engine(Engine::LlamaCpp))
        );
        assert_eq!(
            "llama.cpp".parse::<EngineKind>(),
            Ok(EngineKind::Engine(Engine::LlamaCpp))
        );
        assert_eq!(
            "VLLM".parse::<EngineKind>(),
            Ok(EngineKind::Engine(Engine::Vllm))
        );
        assert_eq!("openai".parse::<EngineKind>(), Ok(EngineKind::OpenAi));
        assert_eq!(
            "triton".parse::<EngineKind>(),
            Err(UnknownKind("triton".to_owned()))
        );
        assert_eq!(
            "openai".parse::<Engine>(),
            Err(UnknownKind("openai".to_owned()))
        );
        let err = serde_json::from_str::<EngineKind>("\"triton\"").expect_err("unknown");
        assert!(err.to_string().contains("expected auto, llamacpp"), "{err}");
    }
}
