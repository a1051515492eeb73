//! Waste: tokens (and money) spent that a cache, a tighter `max_tokens` or a shorter prompt
//! would have saved.
//!
//! Over the successful (`ok`) records of a window:
//!
//! * **Duplicate prompts.** Records with the same `(model, prompt_hash)`; the first one is the
//!   original, every later one a repeat. An exact-match **response cache** would have answered
//!   each repeat: its saving is the repeat's input + output tokens (and its cost). The input
//!   tokens alone (what a prompt/prefix cache saves) are reported beside it.
//! * **Near-identical prompts.** Records of one model whose prompt sketches
//!   (`prompt_sketch`, computed at the gateway: a SimHash of the prompt's word shingles with
//!   numbers and ids masked; no text) are within `near_max_distance` bits, chained, holding at
//!   least two distinct prompts: templated prompts whose id or date changes. Every request
//!   after a group's first that is not an exact repeat is what a template-aware cache would
//!   have served (reported, not added to the total: the answers may differ).
//! * **Truncation.** Per request type, the share of records with `finish_reason = "length"`
//!   (cut by `max_tokens`): a quality problem, not a saving (reported, not added to the total).
//! * **Output length.** Per request type with at least `min_samples` outputs: the median output;
//!   outputs above `overlong_factor × median` are **overlong**; the suggested `max_tokens` is
//!   the nearest-rank P99 of the outputs that ended with `stop` and are not overlong, rounded up
//!   to a multiple of 16. An overlong output's saving is its tokens above the suggestion.
//! * **Bloated prompts.** Per request type with at least `min_samples` records with input and
//!   output: `x = ln(input / max(output, 1))`; fence = `Q3 + max(bloat_iqr_k × IQR, ln 2)`
//!   (so a prompt must be at least twice the upper-quartile ratio); above the fence the excess
//!   input is `input − round(exp(fence) × max(output, 1))` tokens (conservative: only what is
//!   above the fence).
//! * **Total.** Each record contributes once: a repeat saves its whole tokens; otherwise its
//!   overlong excess plus its bloated excess. USD: exact for token-priced models (the saved
//!   input and output tokens at their prices); for self-hosted models the record's cost share
//!   of the saved tokens; `null` when no saved record is priced.
//!
//! Invariants: pure (no clock, no I/O); tables sorted by name, lists by saving then key, so
//! JSON is deterministic; O(n log n) (grouping with ordered maps, one sort per group).

use crate::{csv_opt, nearest_rank, table, total_tokens, CsvRows, PriceTable, Report, Window};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use tokenscope_core::{Outcome, RequestRecord};

/// Options (defaults in [`WasteOptions::default`]).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WasteOptions {
    /// Minimum records of a request type for length and bloat statistics (20).
    pub min_samples: usize,
    /// Overlong: output above this many times the type's median (4).
    pub overlong_factor: f64,
    /// Bloated: IQR multiplier of the log-ratio fence (3).
    pub bloat_iqr_k: f64,
    /// Duplicates listed (top N by tokens saved) (10).
    pub top: usize,
    /// Near-duplicates: prompt sketches at most this many bits apart are near-identical (7,
    /// at most 7). Masked fields (numbers, ids, dates) move no bit; a one-word edit moves
    /// about 8 bits in a 25-word prompt, fewer in a longer one; unrelated prompts differ in
    /// 20–40.
    pub near_max_distance: u32,
}

impl Default for WasteOptions {
    fn default() -> Self {
        Self {
            min_samples: 20,
            overlong_factor: 4.0,
            bloat_iqr_k: 3.0,
            top: 10,
            near_max_distance: 7,
        }
    }
}

impl WasteOptions {
    /// Checks the values.
    pub fn validate(&self) -> Result<(), crate::AnalysisError> {
        let bad = |m: &str| Err(crate::AnalysisError::InvalidOption(m.to_string()));
        if self.min_samples == 0 {
            return bad("minimum samples must be at least 1");
        }
        if !(self.overlong_factor.is_finite() && self.overlong_factor > 1.0) {
            return bad("overlong factor must be > 1");
        }
        if !(self.bloat_iqr_k.is_finite() && self.bloat_iqr_k >= 0.0) {
            return bad("bloat IQR multiplier must be ≥ 0");
        }
        if self.near_max_distance > 7 {
            return bad("near-duplicate distance must be at most 7 bits");
        }
        Ok(())
    }
}

/// One repeated prompt.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DuplicatePrompt {
    /// Model.
    pub model: String,
    /// Prompt hash.
    pub prompt_hash: String,
    /// Requests with it (original + repeats).
    pub requests: u64,
    /// Repeats (requests − 1).
    pub repeats: u64,
    /// Distinct callers (user, else API key, else tenant).
    pub callers: u64,
    /// Who sent it: the callers with the most requests of this prompt, most first (at most
    /// [`TOP_CALLERS`]), each with its business line (the one fix is at that caller).
    pub top_callers: Vec<PromptCaller>,
    /// Input tokens of the repeats.
    pub repeat_input_tokens: u64,
    /// Input + output tokens of the repeats (response-cache saving).
    pub saved_tokens: u64,
    /// Cost of the repeats, USD.
    pub saved_usd: Option<f64>,
}

/// Callers listed per repeated prompt.
pub const TOP_CALLERS: usize = 3;

/// One caller of a repeated prompt.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PromptCaller {
    /// User, else `key:<api key id>`, else `tenant:<tenant>`, else `(none)`.
    pub caller: String,
    /// Its requests with the prompt.
    pub requests: u64,
    /// Its business line (of its first request with the prompt), if any.
    pub business_line: Option<String>,
}

/// Duplicates summary.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct Duplicates {
    /// Distinct `(model, prompt_hash)` seen more than once.
    pub prompts: u64,
    /// Repeat records.
    pub repeats: u64,
    /// Input tokens of the repeats (a prompt cache's saving).
    pub input_tokens: u64,
    /// Input + output tokens of the repeats (a response cache's saving).
    pub saved_tokens: u64,
    /// Their cost, USD.
    pub saved_usd: Option<f64>,
    /// The largest, by tokens saved.
    pub top: Vec<DuplicatePrompt>,
}

/// A group of near-identical prompts: one model, distinct prompt texts whose similarity
/// sketches are within [`WasteOptions::near_max_distance`] bits of one another (chained):
/// templated prompts whose id, date or amount changes (masked in the sketch), or a word or two.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct NearDuplicateGroup {
    /// Model.
    pub model: String,
    /// The sketch of the group's first request, 16 hex digits.
    pub sketch: String,
    /// Requests in the group.
    pub requests: u64,
    /// Distinct prompts (prompt hashes) among them (≥ 2).
    pub distinct_prompts: u64,
    /// Largest distance between a member's sketch and the first one's, bits.
    pub max_distance: u32,
    /// Distinct callers.
    pub callers: u64,
    /// The callers with the most requests in the group (at most [`TOP_CALLERS`]).
    pub top_callers: Vec<PromptCaller>,
    /// Input tokens of the requests after the first that are not exact repeats (those are in
    /// [`Duplicates`]): what a cache keyed by the template would have served.
    pub input_tokens: u64,
    /// Their input + output tokens.
    pub saved_tokens: u64,
    /// Their cost, USD.
    pub saved_usd: Option<f64>,
}

/// Near-duplicate summary. Not added to [`WasteReport::saving`]: near-identical prompts may
/// need different answers (the id changed), so this is what a template-aware or semantic cache
/// could save at most, not what an exact cache saves.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct NearDuplicates {
    /// Groups.
    pub groups: u64,
    /// Requests in them after each group's first, exact repeats excluded.
    pub requests: u64,
    /// Their input tokens.
    pub input_tokens: u64,
    /// Their input + output tokens.
    pub saved_tokens: u64,
    /// Their cost, USD.
    pub saved_usd: Option<f64>,
    /// The largest groups, by tokens.
    pub top: Vec<NearDuplicateGroup>,
}

/// Per request type: truncation, output length, bloat.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RequestTypeWaste {
    /// Request type.
    pub request_type: String,
    /// Successful records.
    pub requests: u64,
    /// Records with a known finish reason.
    pub with_finish_reason: u64,
    /// `finish_reason = "length"`.
    pub truncated: u64,
    /// `truncated / with_finish_reason`.
    pub truncated_share: f64,
    /// Output tokens of the truncated records.
    pub truncated_output_tokens: u64,
    /// Median of the `max_tokens` the callers asked for (`null`: none set).
    pub median_max_tokens: Option<u64>,
    /// Median output tokens (`null`: fewer than `min_samples`).
    pub median_output: Option<f64>,
    /// Nearest-rank P99 of the normal `stop` outputs.
    pub p99_stop_output: Option<u64>,
    /// Suggested `max_tokens` (P99 rounded up to 16).
    pub suggested_max_tokens: Option<u64>,
    /// Outputs above `overlong_factor × median`.
    pub overlong: u64,
    /// Output tokens above the suggestion in the overlong outputs.
    pub overlong_excess_tokens: u64,
    /// Upper fence of ln(input/output) (`null`: fewer than `min_samples`).
    pub bloat_fence_ratio: Option<f64>,
    /// Prompts above the fence.
    pub bloated: u64,
    /// Input tokens above the fence.
    pub bloated_excess_tokens: u64,
}

/// Estimated saving.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct Saving {
    /// Tokens (each record counted once).
    pub tokens: u64,
    /// Share of all tokens of the window, 0–1.
    pub share_of_tokens: f64,
    /// USD (`null` when nothing saved is priced).
    pub usd: Option<f64>,
}

/// The waste of a window.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct WasteReport {
    /// The window.
    pub window: Window,
    /// Successful records analysed.
    pub records: u64,
    /// Their tokens.
    pub tokens: u64,
    /// Options used (thresholds).
    pub options: WasteOptions,
    /// Duplicate prompts.
    pub duplicates: Duplicates,
    /// Near-identical prompts (from the prompt sketches).
    pub near_duplicates: NearDuplicates,
    /// Per request type, by name.
    pub request_types: Vec<RequestTypeWaste>,
    /// Total estimated saving.
    pub saving: Saving,
}

/// Rounds up to a multiple of 16 (0 stays 0... but at least 16).
pub fn round_up_16(x: u64) -> u64 {
    x.div_ceil(16).max(1) * 16
}

/// Quartiles (Q1, Q3) of sorted `v`, linear interpolation.
fn quartiles(sorted: &[f64]) -> (f64, f64) {
    let q = |p: f64| {
        let pos = p * (sorted.len() - 1) as f64;
        let lo = pos.floor() as usize;
        let hi = pos.ceil() as usize;
        sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
    };
    (q(0.25), q(0.75))
}

fn median_u64(sorted: &[u64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2] as f64
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) as f64 / 2.0
    }
}

/// Computes the waste of `records` (the window's records).
pub fn waste(
    records: &[RequestRecord],
    window: Window,
    prices: &PriceTable,
    opts: &WasteOptions,
) -> WasteReport {
    // Costs over every record of the window (a self-hosted model's hourly cost is spread over
    // all the tokens it served), then kept for the successful ones.
    let all_costs = prices.costs(records, window.seconds());
    let (ok, costs): (Vec<&RequestRecord>, Vec<Option<f64>>) = records
        .iter()
        .zip(all_costs)
        .filter(|(r, _)| r.outcome == Outcome::Ok && window.contains(r.created_at))
        .unzip();
    // Per record: saved (input, output) tokens; repeats save everything.
    let mut saved: Vec<(u64, u64)> = vec![(0, 0); ok.len()];
    let mut repeat = vec![false; ok.len()];

    // Duplicates.
    let mut by_prompt: HashMap<(&str, &str), Vec<usize>> = HashMap::new();
    for (i, r) in ok.iter().enumerate() {
        if let Some(h) = r.prompt_hash.as_deref() {
            by_prompt.entry((r.model.as_str(), h)).or_default().push(i);
        }
    }
    // Only repeated prompts, in key order (sums in a fixed order: deterministic output).
    let mut by_prompt: Vec<((&str, &str), Vec<usize>)> =
        by_prompt.into_iter().filter(|(_, v)| v.len() > 1).collect();
    by_prompt.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    let mut dups = Duplicates::default();
    let mut list = Vec::new();
    for ((model, hash), idx) in &by_prompt {
        if idx.len() < 2 {
            continue;
        }
        let mut d = DuplicatePrompt {
            model: model.to_string(),
            prompt_hash: hash.to_string(),
            requests: idx.len() as u64,
            repeats: idx.len() as u64 - 1,
            callers: 0,
            top_callers: Vec::new(),
            repeat_input_tokens: 0,
            saved_tokens: 0,
            saved_usd: None,
        };
        (d.callers, d.top_callers) = callers_of(&ok, idx);
        for &i in &idx[1..] {
            repeat[i] = true;
            d.repeat_input_tokens += ok[i].input_tokens.unwrap_or(0);
            d.saved_tokens += total_tokens(ok[i]);
            if let Some(c) = costs[i] {
                d.saved_usd = Some(d.saved_usd.unwrap_or(0.0) + c);
            }
        }
        dups.prompts += 1;
        dups.repeats += d.repeats;
        dups.input_tokens += d.repeat_input_tokens;
        dups.saved_tokens += d.saved_tokens;
        if let Some(c) = d.saved_usd {
            dups.saved_usd = Some(dups.saved_usd.unwrap_or(0.0) + c);
        }
        list.push(d);
    }
    list.sort_by(|a, b| {
        b.saved_tokens
            .cmp(&a.saved_tokens)
            .then_with(|| a.model.cmp(&b.model))
            .then_with(|| a.prompt_hash.cmp(&b.prompt_hash))
    });
    list.truncate(opts.top);
    dups.top = list;
    let near_duplicates = near_duplicates(&ok, &costs, &repeat, opts);

    // Per request type.
    let mut by_type: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, r) in ok.iter().enumerate() {
        by_type.entry(r.request_type.as_str()).or_default().push(i);
    }
    let mut types = Vec::new();
    for (rt, idx) in &by_type {
        let mut w = RequestTypeWaste {
            request_type: rt.to_string(),
            requests: idx.len() as u64,
            with_finish_reason: 0,
            truncated: 0,
            truncated_share: 0.0,
            truncated_output_tokens: 0,
            median_max_tokens: None,
            median_output: None,
            p99_stop_output: None,
            suggested_max_tokens: None,
            overlong: 0,
            overlong_excess_tokens: 0,
            bloat_fence_ratio: None,
            bloated: 0,
            bloated_excess_tokens: 0,
        };
        let mut max_tokens = Vec::new();
        for &i in idx {
            let r = ok[i];
            if let Some(f) = r.finish_reason.as_deref() {
                w.with_finish_reason += 1;
                if f == "length" {
                    w.truncated += 1;
                    w.truncated_output_tokens += r.output_tokens.unwrap_or(0);
                }
            }
            if let Some(m) = r.max_tokens {
                max_tokens.push(m);
            }
        }
        if w.with_finish_reason > 0 {
            w.truncated_share = w.truncated as f64 / w.with_finish_reason as f64;
        }
        max_tokens.sort_unstable();
        if !max_tokens.is_empty() {
            w.median_max_tokens = Some(max_tokens[(max_tokens.len() - 1) / 2]);
        }
        // Output length.
        let mut outputs: Vec<u64> = idx.iter().filter_map(|&i| ok[i].output_tokens).collect();
        if outputs.len() >= opts.min_samples && !outputs.is_empty() {
            outputs.sort_unstable();
            let med = median_u64(&outputs);
            w.median_output = Some(med);
            let limit = opts.overlong_factor * med;
            let mut normal_stop: Vec<u64> = idx
                .iter()
                .map(|&i| ok[i])
                .filter(|r| r.finish_reason.as_deref() == Some("stop"))
                .filter_map(|r| r.output_tokens)
                .filter(|&o| (o as f64) <= limit)
                .collect();
            normal_stop.sort_unstable();
            w.p99_stop_output = nearest_rank(&normal_stop, 0.99);
            w.suggested_max_tokens = w.p99_stop_output.map(round_up_16);
            if let Some(sugg) = w.suggested_max_tokens {
                for &i in idx {
                    let o = ok[i].output_tokens.unwrap_or(0);
                    if (o as f64) > limit && med > 0.0 {
                        w.overlong += 1;
                        let excess = o.saturating_sub(sugg);
                        w.overlong_excess_tokens += excess;
                        if !repeat[i] {
                            saved[i].1 += excess;
                        }
                    }
                }
            }
        }
        // Bloated prompts.
        let pairs: Vec<(usize, f64)> = idx
            .iter()
            .filter_map(|&i| {
                let r = ok[i];
                let inp = r.input_tokens.filter(|&x| x > 0)?;
                let out = r.output_tokens?;
                Some((i, (inp as f64 / out.max(1) as f64).ln()))
            })
            .collect();
        if pairs.len() >= opts.min_samples && !pairs.is_empty() {
            let mut xs: Vec<f64> = pairs.iter().map(|p| p.1).collect();
            xs.sort_by(f64::total_cmp);
            let (q1, q3) = quartiles(&xs);
            let fence = q3 + (opts.bloat_iqr_k * (q3 - q1)).max(std::f64::consts::LN_2);
            w.bloat_fence_ratio = Some(fence.exp());
            for (i, x) in pairs {
                if x > fence {
                    let r = ok[i];
                    let allowed = fence.exp() * r.output_tokens.unwrap_or(0).max(1) as f64;
                    let excess = r
                        .input_tokens
                        .unwrap_or(0)
                        .saturating_sub(allowed.round() as u64);
                    w.bloated += 1;
                    w.bloated_excess_tokens += excess;
                    if !repeat[i] {
                        saved[i].0 += excess;
                    }
                }
            }
        }
        types.push(w);
    }

    // Total.
    let mut saving = Saving::default();
    let all_tokens: u64 = ok.iter().map(|r| total_tokens(r)).sum();
    for (i, r) in ok.iter().enumerate() {
        let (tokens, usd) = if repeat[i] {
            (total_tokens(r), costs[i])
        } else {
            let (si, so) = saved[i];
            if si + so == 0 {
                continue;
            }
            let part = RequestRecord {
                model: r.model.clone(),
                input_tokens: Some(si),
                output_tokens: Some(so),
                ..RequestRecord::default()
            };
            let usd = prices
                .token_cost(&part)
                .or_else(|| costs[i].map(|c| c * (si + so) as f64 / total_tokens(r).max(1) as f64));
            (si + so, usd)
        };
        saving.tokens += tokens;
        if let Some(c) = usd {
            saving.usd = Some(saving.usd.unwrap_or(0.0) + c);
        }
    }
    if all_tokens > 0 {
        saving.share_of_tokens = saving.tokens as f64 / all_tokens as f64;
    }
    WasteReport {
        window,
        records: ok.len() as u64,
        tokens: all_tokens,
        options: opts.clone(),
        duplicates: dups,
        near_duplicates,
        request_types: types,
        saving,
    }
}

/// Groups the records by near-identical prompt sketches (see [`NearDuplicateGroup`]).
///
/// Candidates by locality-sensitive hashing: two sketches within `d ≤ 7` bits agree on at
/// least one of eight 8-bit bands (pigeonhole), so only sketches sharing a band (same model)
/// are compared (at most 64 per bucket); each pair within `d` is joined (union-find). Distinct sketches are compared,
/// not records: a million copies of one template cost one comparison.
fn near_duplicates(
    ok: &[&RequestRecord],
    costs: &[Option<f64>],
    repeat: &[bool],
    opts: &WasteOptions,
) -> NearDuplicates {
    let d = opts.near_max_distance.min(7);
    // Distinct (model, sketch), in first-seen order, with their records.
    let mut ids: HashMap<(&str, u64), usize> = HashMap::new();
    let mut sketches: Vec<(&str, u64, Vec<usize>)> = Vec::new();
    let mut order: Vec<usize> = (0..ok.len()).collect();
    order.sort_by(|&a, &b| {
        ok[a]
            .created_at
            .cmp(&ok[b].created_at)
            .then_with(|| ok[a].request_id.cmp(&ok[b].request_id))
    });
    for &i in &order {
        let r = ok[i];
        let (Some(sk), Some(_)) = (r.prompt_sketch, r.prompt_hash.as_deref()) else {
            continue;
        };
        let id = *ids.entry((r.model.as_str(), sk)).or_insert_with(|| {
            sketches.push((r.model.as_str(), sk, Vec::new()));
            sketches.len() - 1
        });
        sketches[id].2.push(i);
    }
    let mut parent: Vec<usize> = (0..sketches.len()).collect();
    fn find(p: &mut [usize], mut x: usize) -> usize {
        while p[x] != x {
            p[x] = p[p[x]];
            x = p[x];
        }
        x
    }
    let mut bands: HashMap<(&str, u8, u8), Vec<usize>> = HashMap::new();
    for (id, (model, sk, _)) in sketches.iter().enumerate() {
        for band in 0..8u8 {
            let v = (sk >> (8 * u32::from(band))) as u8;
            bands.entry((model, band, v)).or_default().push(id);
        }
    }
    // Compare within each band bucket (bounded: at most 64 members against each other).
    let mut keys: Vec<_> = bands.keys().copied().collect();
    keys.sort_unstable();
    for k in keys {
        let members = &bands[&k];
        let cap = members.len().min(64);
        for (x, &a) in members.iter().enumerate() {
            for &b in &members[..cap.min(x)] {
                if tokenscope_core::prompt::sketch_distance(sketches[a].1, sketches[b].1) <= d {
                    let (ra, rb) = (find(&mut parent, a), find(&mut parent, b));
                    if ra != rb {
                        parent[ra.max(rb)] = ra.min(rb);
                    }
                }
            }
        }
    }
    let mut groups: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for id in 0..sketches.len() {
        let root = find(&mut parent, id);
        groups.entry(root).or_default().push(id);
    }
    let mut out = NearDuplicates::default();
    let mut list = Vec::new();
    for (root, members) in groups {
        let mut recs: Vec<usize> = members
            .iter()
            .flat_map(|&m| sketches[m].2.iter().copied())
            .collect();
        recs.sort_by(|&a, &b| {
            ok[a]
                .created_at
                .cmp(&ok[b].created_at)
                .then_with(|| ok[a].request_id.cmp(&ok[b].request_id))
        });
        let distinct: std::collections::BTreeSet<&str> = recs
            .iter()
            .filter_map(|&i| ok[i].prompt_hash.as_deref())
            .collect();
        if distinct.len() < 2 {
            continue; // one prompt: exact duplicates, reported there
        }
        let first = sketches[root].1;
        let mut g = NearDuplicateGroup {
            model: sketches[root].0.to_owned(),
            sketch: format!("{first:016x}"),
            requests: recs.len() as u64,
            distinct_prompts: distinct.len() as u64,
            max_distance: members
                .iter()
                .map(|&m| tokenscope_core::prompt::sketch_distance(first, sketches[m].1))
                .max()
                .unwrap_or(0),
            callers: 0,
            top_callers: Vec::new(),
            input_tokens: 0,
            saved_tokens: 0,
            saved_usd: None,
        };
        (g.callers, g.top_callers) = callers_of(ok, &recs);
        for &i in recs.iter().skip(1).filter(|&&i| !repeat[i]) {
            out.requests += 1;
            g.input_tokens += ok[i].input_tokens.unwrap_or(0);
            g.saved_tokens += total_tokens(ok[i]);
            if let Some(c) = costs[i] {
                g.saved_usd = Some(g.saved_usd.unwrap_or(0.0) + c);
            }
        }
        out.groups += 1;
        out.input_tokens += g.input_tokens;
        out.saved_tokens += g.saved_tokens;
        if let Some(c) = g.saved_usd {
            out.saved_usd = Some(out.saved_usd.unwrap_or(0.0) + c);
        }
        list.push(g);
    }
    list.sort_by(|a, b| {
        b.saved_tokens
            .cmp(&a.saved_tokens)
            .then_with(|| a.model.cmp(&b.model))
            .then_with(|| a.sketch.cmp(&b.sketch))
    });
    list.truncate(opts.top);
    out.top = list;
    out
}

/// Distinct callers of the records `idx` and the [`TOP_CALLERS`] with the most requests (ties
/// by name), each with the business line of its first request.
fn callers_of(ok: &[&RequestRecord], idx: &[usize]) -> (u64, Vec<PromptCaller>) {
    let mut per_caller: BTreeMap<std::borrow::Cow<'_, str>, (u64, Option<&str>)> = BTreeMap::new();
    for &i in idx {
        let e = per_caller
            .entry(crate::anomalies::caller_key(ok[i]))
            .or_insert((0, ok[i].business_line.as_deref()));
        e.0 += 1;
    }
    let n = per_caller.len() as u64;
    let mut callers: Vec<_> = per_caller.into_iter().collect();
    callers.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then_with(|| a.0.cmp(&b.0)));
    let top = callers
        .into_iter()
        .take(TOP_CALLERS)
        .map(|(c, (n, bl))| PromptCaller {
            caller: c.into_owned(),
            requests: n,
            business_line: bl.map(str::to_owned),
        })
        .collect();
    (n, top)
}

fn usd(x: Option<f64>) -> String {
    x.map_or("-".to_string(), |c| format!("${c:.4}"))
}

impl Report for WasteReport {
    fn render_table(&self) -> String {
        let mut out = format!(
            "Waste {} → {} UTC: {} successful requests, {} tokens\n",
            tokenscope_core::time::format_date_time(self.window.since_us),
            tokenscope_core::time::format_date_time(self.window.until_us),
            self.records,
            self.tokens
        );
        let d = &self.duplicates;
        out.push_str(&format!(
            "\nDuplicate prompts: {} prompts repeated {} times; a response cache saves {} tokens ({}), a prompt cache {} input tokens\n",
            d.prompts, d.repeats, d.saved_tokens, usd(d.saved_usd), d.input_tokens
        ));
        if !d.top.is_empty() {
            let mut t = table(&[
                "model",
                "prompt hash",
                "requests",
                "callers",
                "top caller (requests, line)",
                "tokens saved",
                "saved (USD)",
            ]);
            for x in &d.top {
                t.add_row(vec![
                    x.model.clone(),
                    x.prompt_hash
                        .get(..16)
                        .unwrap_or(&x.prompt_hash)
                        .to_string(),
                    x.requests.to_string(),
                    x.callers.to_string(),
                    x.top_callers
                        .first()
                        .map(|c| {
                            format!(
                                "{} ({}, {})",
                                c.caller,
                                c.requests,
                                c.business_line.as_deref().unwrap_or("-")
                            )
                        })
                        .unwrap_or_default(),
                    x.saved_tokens.to_string(),
                    usd(x.saved_usd),
                ]);
            }
            out.push_str(&t.to_string());
            out.push('\n');
        }
        let n = &self.near_duplicates;
        out.push_str(&format!(
            "\nNear-identical prompts (sketches ≤ {} bits apart; numbers and ids masked): {} groups, {} requests after each group's first; a template-aware cache would serve {} tokens ({}), {} of them input\n",
            self.options.near_max_distance, n.groups, n.requests, n.saved_tokens, usd(n.saved_usd), n.input_tokens
        ));
        if !n.top.is_empty() {
            let mut t = table(&[
                "model",
                "sketch",
                "requests",
                "prompts",
                "top caller (requests, line)",
                "tokens after the first",
                "(USD)",
            ]);
            for x in &n.top {
                t.add_row(vec![
                    x.model.clone(),
                    x.sketch.clone(),
                    x.requests.to_string(),
                    x.distinct_prompts.to_string(),
                    x.top_callers
                        .first()
                        .map(|c| {
                            format!(
                                "{} ({}, {})",
                                c.caller,
                                c.requests,
                                c.business_line.as_deref().unwrap_or("-")
                            )
                        })
                        .unwrap_or_default(),
                    x.saved_tokens.to_string(),
                    usd(x.saved_usd),
                ]);
            }
            out.push_str(&t.to_string());
            out.push('\n');
        }
        let o = &self.options;
        out.push_str(&format!(
            "\nPer request type (overlong: > {}× median output; suggested max_tokens: P99 of normal `stop` outputs rounded up to 16; bloated: ln(in/out) > Q3 + max({}·IQR, ln 2); statistics need ≥ {} requests)\n",
            o.overlong_factor, o.bloat_iqr_k, o.min_samples
        ));
        let mut t = table(&[
            "request type",
            "requests",
            "truncated (length)",
            "median out (tokens)",
            "max_tokens now → suggested",
            "overlong (excess tokens)",
            "bloated (excess input)",
        ]);
        let opt = |x: Option<u64>| x.map_or("-".to_string(), |v| v.to_string());
        for w in &self.request_types {
            t.add_row(vec![
                w.request_type.clone(),
                w.requests.to_string(),
                format!("{} ({:.1} %)", w.truncated, w.truncated_share * 100.0),
                w.median_output
                    .map_or("-".to_string(), |m| format!("{m:.0}")),
                format!(
                    "{} → {}",
                    opt(w.median_max_tokens),
                    opt(w.suggested_max_tokens)
                ),
                format!("{} ({})", w.overlong, w.overlong_excess_tokens),
                format!("{} ({})", w.bloated, w.bloated_excess_tokens),
            ]);
        }
        out.push_str(&t.to_string());
        out.push_str(&format!(
            "\nEstimated saving: {} tokens ({:.1} % of the window), {}\n",
            self.saving.tokens,
            self.saving.share_of_tokens * 100.0,
            usd(self.saving.usd)
        ));
        out
    }

    /// One row per request type (the duplicate prompts and the totals are in the JSON form).
    fn csv_rows(&self) -> CsvRows {
        let mut out = CsvRows::new(&[
            "request_type",
            "requests",
            "truncated",
            "truncated_share",
            "median_output_tokens",
            "median_max_tokens",
            "suggested_max_tokens",
            "overlong",
            "overlong_excess_tokens",
            "bloated",
            "bloated_excess_tokens",
        ]);
        for w in &self.request_types {
            out.push(vec![
                w.request_type.clone(),
                w.requests.to_string(),
                w.truncated.to_string(),
                w.truncated_share.to_string(),
                csv_opt(w.median_output),
                csv_opt(w.median_max_tokens),
                csv_opt(w.suggested_max_tokens),
                w.overlong.to_string(),
                w.overlong_excess_tokens.to_string(),
                w.bloated.to_string(),
                w.bloated_excess_tokens.to_string(),
            ]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ModelPrice;
    use proptest::prelude::*;

    fn rec(i: i64, rt: &str, hash: &str, input: u64, output: u64, finish: &str) -> RequestRecord {
        RequestRecord {
            request_id: format!("r{i:05}"),
            created_at: i * 1000,
            model: "m".into(),
            user_id: Some("u".into()),
            request_type: rt.into(),
            prompt_hash: Some(hash.into()),
            input_tokens: Some(input),
            output_tokens: Some(output),
            finish_reason: Some(finish.into()),
            ..RequestRecord::default()
        }
    }

    fn w() -> Window {
        Window {
            since_us: 0,
            until_us: 3_600_000_000,
        }
    }

    fn prices() -> PriceTable {
        PriceTable::new(vec![ModelPrice {
            model: "m".into(),
            input_per_mtok: 1.0,
            output_per_mtok: 2.0,
            ..ModelPrice::default()
        }])
    }

    #[test]
    fn every_kind_of_waste_counted_once() {
        let mut v = Vec::new();
        let mut i = 0;
        let mut push = |rt: &str, h: String, inp, out, f: &str| {
            v.push(rec(i, rt, &h, inp, out, f));
            i += 1;
        };
        // 20 normal summaries of 50 tokens, 2 overlong of 400.
        for k in 0..20 {
            push("sum", format!("s{k}"), 100, 50, "stop");
        }
        for k in 0..2 {
            push("sum", format!("long{k}"), 100, 400, "stop");
        }
        // One prompt sent 5 times: 4 repeats of 30 in + 10 out.
        for _ in 0..5 {
            push("faq", "dup".into(), 30, 10, "stop");
        }
        // Truncation: 3 of 4 cut.
        for k in 0..4 {
            push(
                "extract",
                format!("e{k}"),
                20,
                16,
                if k < 3 { "length" } else { "stop" },
            );
        }
        // 20 classifications of ratio 4, one bloated 2000/10.
        for k in 0..20 {
            push("cls", format!("c{k}"), 40, 10, "stop");
        }
        push("cls", "big".into(), 2000, 10, "stop");
        let r = waste(&v, w(), &prices(), &WasteOptions::default());
        assert_eq!(r.duplicates.prompts, 1);
        assert_eq!(r.duplicates.repeats, 4);
        assert_eq!(r.duplicates.input_tokens, 120);
        assert_eq!(r.duplicates.saved_tokens, 160);
        let sum = &r.request_types[3];
        assert_eq!(sum.request_type, "sum");
        assert_eq!(sum.median_output, Some(50.0));
        assert_eq!(sum.suggested_max_tokens, Some(64));
        assert_eq!(sum.overlong, 2);
        assert_eq!(sum.overlong_excess_tokens, 2 * (400 - 64));
        let ex = &r.request_types[1];
        assert_eq!((ex.truncated, ex.with_finish_reason), (3, 4));
        assert!((ex.truncated_share - 0.75).abs() < 1e-12);
        let cls = &r.request_types[0];
        assert_eq!(cls.bloated, 1);
        // fence = ln 4 + ln 2 → ratio 8 → allowed 80 input tokens.
        assert_eq!(cls.bloated_excess_tokens, 2000 - 80);
        assert_eq!(r.saving.tokens, 160 + 672 + 1920);
        // USD: repeats 4 × (30×1 + 10×2)/1e6, overlong 672 × 2/1e6, bloat 1920 × 1/1e6.
        let expected = (4.0 * 50.0 + 672.0 * 2.0 + 1920.0) / 1e6;
        assert!((r.saving.usd.expect("priced") - expected).abs() < 1e-12);
        let table = r.render_table();
        assert!(table.contains("Estimated saving"));
    }

    #[test]
    fn templated_prompts_are_near_duplicates_with_their_saving() {
        // Issue 21: a ticket bot fills one template with a changing id and date (40 distinct
        // prompts; 5 of them sent twice), a person edits one word of another prompt, and 20
        // unrelated prompts: one group of the bot's 45 requests, exact repeats left to the
        // duplicates, the edit grouped with its original, nothing else.
        use tokenscope_core::prompt::{prompt_hash, prompt_sketch};
        let template = |id: usize| {
            format!(
                "Summarise ticket T-{id} opened on 2026-12-{:02} for the on-call engineer: list \
                 the affected services, the steps already tried and the next action.",
                id % 28 + 1
            )
        };
        let mut v = Vec::new();
        let push = |text: &str, user: &str, v: &mut Vec<RequestRecord>| {
            let mut r = rec(
                v.len() as i64,
                "chat",
                &prompt_hash("m", text),
                30,
                10,
                "stop",
            );
            r.prompt_sketch = prompt_sketch(text);
            r.user_id = Some(user.to_owned());
            r.business_line = Some("support".to_owned());
            v.push(r);
        };
        for id in 0..40 {
            push(&template(id), "ticket-bot", &mut v);
            if id % 8 == 0 {
                push(&template(id), "ticket-bot", &mut v); // exact repeat
            }
        }
        let essay = "Explain the difference between a process and a thread in an operating \
                     system, with an example of each and when to prefer one over the other. \
                     Then describe how the scheduler decides which of them runs next, what a \
                     context switch costs, and how shared memory between threads is protected \
                     with locks, atomics or message passing in a modern language runtime.";
        push(essay, "alice", &mut v);
        push(&essay.replace("an example", "one example"), "alice", &mut v);
        for k in 0..20 {
            push(
                &format!(
                    "Question {}: {}",
                    "xyz".repeat(k + 1),
                    [
                        "tell me a joke about cats",
                        "how do tides work",
                        "best pasta recipe",
                        "why is the sky blue"
                    ][k % 4]
                ),
                "bob",
                &mut v,
            );
        }
        let r = waste(&v, w(), &prices(), &WasteOptions::default());
        let n = &r.near_duplicates;
        let bot = n
            .top
            .iter()
            .find(|g| g.top_callers[0].caller == "ticket-bot")
            .expect("the bot's group");
        assert_eq!((bot.requests, bot.distinct_prompts), (45, 40));
        assert_eq!(bot.max_distance, 0, "ids and dates are masked");
        assert_eq!(bot.top_callers[0].business_line.as_deref(), Some("support"));
        // 44 after the first, 5 of them exact repeats (in `duplicates`): 39 × 40 tokens.
        assert_eq!(bot.saved_tokens, 39 * 40);
        assert_eq!(bot.input_tokens, 39 * 30);
        assert_eq!(r.duplicates.repeats, 5, "the bot's exact repeats");
        let edit = n
            .top
            .iter()
            .find(|g| g.top_callers[0].caller == "alice")
            .expect("the edited prompt");
        assert_eq!((edit.requests, edit.distinct_prompts), (2, 2));
        assert!(edit.max_distance <= 7);
        assert!(
            n.top.iter().all(|g| g.top_callers[0].caller != "bob"),
            "{n:#?}"
        );
        assert_eq!(n.groups, 2);
        assert_eq!(n.requests, 39 + 1);
        // Not in the total (an exact cache would not serve them).
        assert_eq!(r.saving.tokens, r.duplicates.saved_tokens);
        assert!(r.render_table().contains("Near-identical prompts"));
        assert!(r.render_table().contains("ticket-bot (45, support)"));
    }

    #[test]
    fn duplicates_name_their_callers() {
        // Issue 21: sixty identical prompts from one caller (and two from another) — the
        // report says who, with the business line.
        let mut v: Vec<RequestRecord> = (0..62)
            .map(|i| {
                let mut r = rec(i, "faq", "same", 30, 10, "stop");
                r.user_id = Some(if i < 60 { "looper" } else { "alice" }.to_owned());
                r.business_line = Some(if i < 60 { "search" } else { "ads" }.to_owned());
                r
            })
            .collect();
        v.push(rec(99, "faq", "other", 30, 10, "stop"));
        let r = waste(&v, w(), &prices(), &WasteOptions::default());
        let d = &r.duplicates.top[0];
        assert_eq!((d.requests, d.callers), (62, 2));
        assert_eq!(
            d.top_callers,
            vec![
                PromptCaller {
                    caller: "looper".into(),
                    requests: 60,
                    business_line: Some("search".into())
                },
                PromptCaller {
                    caller: "alice".into(),
                    requests: 2,
                    business_line: Some("ads".into())
                },
            ]
        );
        assert!(r.render_table().contains("looper (60, search)"));
    }

    #[test]
    fn unpriced_has_no_usd_and_errors_are_ignored() {
        let mut v = vec![
            rec(0, "a", "h", 10, 10, "stop"),
            rec(1, "a", "h", 10, 10, "stop"),
        ];
        v[1].outcome = Outcome::UpstreamError;
        let r = waste(&v, w(), &PriceTable::default(), &WasteOptions::default());
        assert_eq!(r.records, 1);
        assert_eq!(r.duplicates.repeats, 0);
        assert_eq!(r.saving.usd, None);
    }

    proptest! {
        #[test]
        fn saving_never_exceeds_tokens(outs in proptest::collection::vec((1u64..5000, 0u64..3000, 0u8..3), 1..200)) {
            let v: Vec<RequestRecord> = outs.iter().enumerate().map(|(i, (inp, out, h))| {
                rec(i as i64, "t", &format!("h{h}{}", i % 7), *inp, *out, if i.is_multiple_of(5) { "length" } else { "stop" })
            }).collect();
            let r = waste(&v, w(), &prices(), &WasteOptions { min_samples: 5, ..WasteOptions::default() });
            prop_assert!(r.saving.tokens <= r.tokens);
            prop_assert!(r.saving.share_of_tokens <= 1.0);
            for t in &r.request_types {
                if let Some(s) = t.suggested_max_tokens {
                    prop_assert!(s.is_multiple_of(16));
                    prop_assert!(s >= t.p99_stop_output.unwrap_or(0));
                }
            }
        }

        #[test]
        fn round_up(x in 0u64..1_000_000) {
            let r = round_up_16(x);
            prop_assert!(r >= x && r.is_multiple_of(16) && r < x + 16 + 16);
        }
    }
}
