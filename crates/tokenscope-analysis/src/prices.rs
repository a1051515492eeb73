//! Prices: what a request cost.
//!
//! Two kinds of entries, matched by model name (exact, `prefix*` or `*`; the first match
//! wins):
//! * API prices — USD per million input, cached input and output tokens. Cost =
//!   (input − cached) × input price + cached × cached price + output × output price.
//! * Self-hosted — a GPU cost per hour (`gpu_hourly_usd`, the whole deployment of that model).
//!   The per-token cost comes from measured throughput: over a window, the deployment's cost
//!   (hours × hourly cost) is spread over the tokens it served, so each record's cost is its
//!   share of the tokens ([`PriceTable::self_hosted_rate`]).
//!
//! Invariants: a record with unknown token counts costs what its known counts cost; a model
//! with no price entry has no cost (`None`), never 0.

use serde::{Deserialize, Serialize};
use tokenscope_core::usage::UsageSums;
use tokenscope_core::RequestRecord;

/// One `[[prices]]` entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ModelPrice {
    /// Model name pattern: exact, `prefix*`, or `*`.
    pub model: String,
    /// USD per 1M (uncached) input tokens.
    #[serde(default)]
    pub input_per_mtok: f64,
    /// USD per 1M cached input tokens (defaults to the input price).
    #[serde(default)]
    pub cached_input_per_mtok: Option<f64>,
    /// USD per 1M output tokens.
    #[serde(default)]
    pub output_per_mtok: f64,
    /// Self-hosted: USD per hour for the GPUs serving this model (replaces token prices).
    #[serde(default)]
    pub gpu_hourly_usd: Option<f64>,
}

impl ModelPrice {
    /// Whether this entry prices `model`.
    pub fn matches(&self, model: &str) -> bool {
        match self.model.strip_suffix('*') {
            Some(prefix) => model.starts_with(prefix),
            None => self.model == model,
        }
    }
}

/// The price table.
#[derive(Debug, Clone, PartialEq, Default, Serialize)]
pub struct PriceTable {
    /// Entries in order; the first match wins.
    pub entries: Vec<ModelPrice>,
}

impl PriceTable {
    /// A table from config entries.
    pub fn new(entries: Vec<ModelPrice>) -> Self {
        Self { entries }
    }

    /// The entry pricing `model`.
    pub fn find(&self, model: &str) -> Option<&ModelPrice> {
        self.entries.iter().find(|p| p.matches(model))
    }

    /// API-priced cost of one record in USD; `None` for unpriced or self-hosted models.
    pub fn token_cost(&self, r: &RequestRecord) -> Option<f64> {
        let p = self.find(&r.model)?;
        if p.gpu_hourly_usd.is_some() {
            return None;
        }
        let input = r.input_tokens.unwrap_or(0) as f64;
        let cached = (r.cached_tokens.unwrap_or(0) as f64).min(input);
        let output = r.output_tokens.unwrap_or(0) as f64;
        let cached_price = p.cached_input_per_mtok.unwrap_or(p.input_per_mtok);
        Some(
            ((input - cached) * p.input_per_mtok
                + cached * cached_price
                + output * p.output_per_mtok)
                / 1e6,
        )
    }

    /// API-priced cost of the requests of `model` a store summed without a stored cost
    /// ([`UsageSums`]'s `unpriced_*` sums): [`token_cost`](Self::token_cost) of those sums,
    /// which prices them exactly as one by one (the price is linear in the tokens). `None` for
    /// unpriced or self-hosted models.
    pub fn token_cost_of_sums(&self, model: &str, s: &UsageSums) -> Option<f64> {
        self.token_cost(&RequestRecord {
            model: model.to_owned(),
            input_tokens: Some(s.unpriced_input_tokens),
            cached_tokens: Some(s.unpriced_cached_within_input),
            output_tokens: Some(s.unpriced_output_tokens),
            ..RequestRecord::default()
        })
    }

    /// Self-hosted USD per token for `model`: `hourly × window hours / tokens served` in the
    /// window (`None` if the model is not self-hosted or served no token).
    pub fn self_hosted_rate(&self, model: &str, window_seconds: f64, tokens: u64) -> Option<f64> {
        let hourly = self.find(model)?.gpu_hourly_usd?;
        (tokens > 0).then(|| hourly * window_seconds / 3600.0 / tokens as f64)
    }

    /// Cost of every record in `records` (same order), with self-hosted models priced by
    /// their share of the tokens their model served in `records` over `window_seconds`.
    pub fn costs(&self, records: &[RequestRecord], window_seconds: f64) -> Vec<Option<f64>> {
        let mut served: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
        for r in records {
            *served.entry(r.model.as_str()).or_default() += crate::total_tokens(r);
        }
        records
            .iter()
            .map(|r| match self.token_cost(r) {
                Some(c) => Some(c),
                None => self
                    .self_hosted_rate(
                        &r.model,
                        window_seconds,
                        served.get(r.model.as_str()).copied().unwrap_or(0),
                    )
                    .map(|rate| rate * crate::total_tokens(r) as f64),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(model: &str, input: u64, cached: u64, output: u64) -> RequestRecord {
        RequestRecord {
            model: model.into(),
            input_tokens: Some(input),
            cached_tokens: Some(cached),
            output_tokens: Some(output),
            ..RequestRecord::default()
        }
    }

    #[test]
    fn api_and_self_hosted_costs() {
        let t = PriceTable::new(vec![
            ModelPrice {
                model: "gpt-4o".into(),
                input_per_mtok: 2.5,
                cached_input_per_mtok: Some(1.25),
                output_per_mtok: 10.0,
                gpu_hourly_usd: None,
            },
            ModelPrice {
                model: "llama*".into(),
                gpu_hourly_usd: Some(4.0),
                ..ModelPrice::default()
            },
        ]);
        // 1M input of which 0.5M cached, 0.1M output: 0.5×2.5 + 0.5×1.25 + 0.1×10 = 2.875.
        let c = t
            .token_cost(&rec("gpt-4o", 1_000_000, 500_000, 100_000))
            .expect("priced");
        assert!((c - 2.875).abs() < 1e-12);
        assert_eq!(t.token_cost(&rec("unknown", 1, 0, 1)), None);
        // Self-hosted: $4/h over half an hour = $2, spread over 1 000 tokens: 300 + 700.
        let recs = [
            rec("llama-3", 200, 0, 100),
            rec("llama-3", 600, 0, 100),
            rec("other", 5, 0, 5),
        ];
        let costs = t.costs(&recs, 1800.0);
        assert!((costs[0].expect("a") - 0.6).abs() < 1e-12);
        assert!((costs[1].expect("b") - 1.4).abs() < 1e-12);
        assert_eq!(costs[2], None);
    }
}
