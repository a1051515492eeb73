//! Record ↔ row mapping.
//!
//! Writes are encoded by hand into ClickHouse's `RowBinary` format straight from a borrowed
//! [`RequestRecord`] ([`encode_row`]: no per-row allocation or string copy), in
//! [`INSERT_COLUMNS`](crate::schema::INSERT_COLUMNS) order; reads decode the same column list
//! with the `clickhouse` crate's RowBinary deserializer into [`LogRow`] and map it back
//! ([`LogRow::into_record`]). The round-trip tests against a real server check that both sides
//! agree with the DDL.
//!
//! RowBinary: integers and floats little-endian, `String` = LEB128 length + bytes,
//! `Nullable(T)` = one byte (1 = NULL) then `T` when not NULL. `LowCardinality(T)` columns take
//! plain `T`, so the layout is the same for both dialects.

use serde::Deserialize;
use tokenscope_core::{Endpoint, InputBucket, Outcome, PhaseSource, RequestRecord, TokenSource};

use crate::ClickHouseError;

fn put_str(buf: &mut Vec<u8>, s: &str) {
    let mut n = s.len() as u64;
    loop {
        let b = (n & 0x7f) as u8;
        n >>= 7;
        if n == 0 {
            buf.push(b);
            break;
        }
        buf.push(b | 0x80);
    }
    buf.extend_from_slice(s.as_bytes());
}

fn put_opt_str(buf: &mut Vec<u8>, s: Option<&str>) {
    match s {
        None => buf.push(1),
        Some(s) => {
            buf.push(0);
            put_str(buf, s);
        }
    }
}

fn put_opt_u64(buf: &mut Vec<u8>, v: Option<u64>) {
    match v {
        None => buf.push(1),
        Some(v) => {
            buf.push(0);
            buf.extend_from_slice(&v.to_le_bytes());
        }
    }
}

fn put_opt_f64(buf: &mut Vec<u8>, v: Option<f64>) {
    match v {
        None => buf.push(1),
        Some(v) => {
            buf.push(0);
            buf.extend_from_slice(&v.to_le_bytes());
        }
    }
}

/// Appends `r` as one RowBinary row (with `row_version`) to `buf`.
pub fn encode_row(buf: &mut Vec<u8>, r: &RequestRecord, row_version: u64) {
    put_str(buf, &r.request_id);
    put_str(buf, &r.trace_id);
    buf.extend_from_slice(&r.created_at.to_le_bytes());
    put_str(buf, &r.model);
    put_opt_str(buf, r.model_served.as_deref());
    put_str(buf, &r.upstream);
    put_opt_str(buf, r.user_id.as_deref());
    put_opt_str(buf, r.tenant.as_deref());
    put_opt_str(buf, r.business_line.as_deref());
    put_str(buf, &r.request_type);
    put_opt_str(buf, r.api_key_id.as_deref());
    put_str(buf, r.endpoint.as_str());
    buf.push(u8::from(r.stream));
    buf.extend_from_slice(&r.http_status.to_le_bytes());
    put_str(buf, r.outcome.as_str());
    put_opt_str(buf, r.error_type.as_deref());
    put_opt_str(buf, r.finish_reason.as_deref());
    put_opt_u64(buf, r.max_tokens);
    put_opt_u64(buf, r.input_tokens);
    put_opt_u64(buf, r.output_tokens);
    put_opt_u64(buf, r.cached_tokens);
    put_opt_u64(buf, r.reasoning_tokens);
    put_str(buf, r.input_tokens_source.as_str());
    put_str(buf, r.output_tokens_source.as_str());
    put_opt_str(buf, r.input_bucket.map(InputBucket::as_str));
    put_opt_f64(buf, r.queue_duration_ms);
    put_opt_f64(buf, r.prefill_duration_ms);
    put_opt_f64(buf, r.decode_duration_ms);
    put_str(buf, r.queue_source.as_str());
    put_str(buf, r.prefill_source.as_str());
    put_str(buf, r.decode_source.as_str());
    put_opt_f64(buf, r.ttft_ms);
    put_opt_f64(buf, r.tpot_ms);
    put_opt_f64(buf, r.itl_max_ms);
    put_opt_f64(buf, r.itl_mean_ms);
    buf.extend_from_slice(&r.total_duration_ms.to_le_bytes());
    put_opt_f64(buf, r.upstream_headers_ms);
    put_opt_f64(buf, r.gateway_overhead_ms);
    put_opt_u64(buf, r.chunks);
    put_opt_str(buf, r.prompt_hash.as_deref());
    put_opt_str(buf, r.prompt_text.as_deref());
    put_opt_u64(buf, r.draft_tokens);
    put_opt_u64(buf, r.draft_accepted_tokens);
    put_opt_str(buf, r.engine.as_deref());
    put_opt_u64(buf, r.input_tokens_entry);
    put_opt_f64(buf, r.engine_running);
    put_opt_f64(buf, r.engine_waiting);
    put_opt_f64(buf, r.engine_kv_usage);
    put_opt_f64(buf, r.gpu_utilization);
    put_opt_f64(buf, r.gpu_memory_bandwidth);
    put_opt_f64(buf, r.cost_usd);
    put_opt_str(buf, r.client_request_id.as_deref());
    put_opt_u64(buf, r.cache_creation_tokens);
    put_str(buf, &r.replica);
    put_opt_u64(buf, r.blocked_by_requests);
    put_opt_u64(buf, r.blocked_by_prompt_tokens);
    put_opt_f64(buf, r.blocked_ms);
    put_opt_str(buf, r.blocker_request_id.as_deref());
    put_opt_str(buf, r.blocker_caller.as_deref());
    put_opt_str(buf, r.blocker_business_line.as_deref());
    put_opt_u64(buf, r.blocker_prompt_tokens);
    put_opt_u64(buf, r.prompt_sketch);
    put_opt_f64(buf, r.ttft_unaccounted_ms);
    put_opt_f64(buf, r.e2e_unaccounted_ms);
    put_opt_str(buf, r.engine_timing.as_deref());
    buf.extend_from_slice(&row_version.to_le_bytes());
}

/// One stored row as read back (`SELECT <INSERT_COLUMNS> … FORMAT RowBinary`).
#[derive(Debug, Clone, clickhouse::Row, Deserialize)]
#[allow(missing_docs)]
pub struct LogRow {
    pub request_id: String,
    pub trace_id: String,
    pub created_at_us: i64,
    pub model: String,
    pub model_served: Option<String>,
    pub upstream: String,
    pub user_id: Option<String>,
    pub tenant: Option<String>,
    pub business_line: Option<String>,
    pub request_type: String,
    pub api_key_id: Option<String>,
    pub endpoint: String,
    pub stream: u8,
    pub http_status: u16,
    pub outcome: String,
    pub error_type: Option<String>,
    pub finish_reason: Option<String>,
    pub max_tokens: Option<u64>,
    pub input_tokens: Option<u64>,
    pub output_tokens: Option<u64>,
    pub cached_tokens: Option<u64>,
    pub reasoning_tokens: Option<u64>,
    pub input_tokens_source: String,
    pub output_tokens_source: String,
    pub input_bucket: Option<String>,
    pub queue_duration_ms: Option<f64>,
    pub prefill_duration_ms: Option<f64>,
    pub decode_duration_ms: Option<f64>,
    pub queue_source: String,
    pub prefill_source: String,
    pub decode_source: String,
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub itl_max_ms: Option<f64>,
    pub itl_mean_ms: Option<f64>,
    pub total_duration_ms: f64,
    pub upstream_headers_ms: Option<f64>,
    pub gateway_overhead_ms: Option<f64>,
    pub chunks: Option<u64>,
    pub prompt_hash: Option<String>,
    pub prompt_text: Option<String>,
    pub draft_tokens: Option<u64>,
    pub draft_accepted_tokens: Option<u64>,
    pub engine: Option<String>,
    pub input_tokens_entry: Option<u64>,
    pub engine_running: Option<f64>,
    pub engine_waiting: Option<f64>,
    pub engine_kv_usage: Option<f64>,
    pub gpu_utilization: Option<f64>,
    pub gpu_memory_bandwidth: Option<f64>,
    pub cost_usd: Option<f64>,
    pub client_request_id: Option<String>,
    pub cache_creation_tokens: Option<u64>,
    pub replica: String,
    pub blocked_by_requests: Option<u64>,
    pub blocked_by_prompt_tokens: Option<u64>,
    pub blocked_ms: Option<f64>,
    pub blocker_request_id: Option<String>,
    pub blocker_caller: Option<String>,
    pub blocker_business_line: Option<String>,
    pub blocker_prompt_tokens: Option<u64>,
    pub prompt_sketch: Option<u64>,
    pub ttft_unaccounted_ms: Option<f64>,
    pub e2e_unaccounted_ms: Option<f64>,
    pub engine_timing: Option<String>,
    pub row_version: u64,
}

fn parse<T>(
    column: &'static str,
    s: &str,
    f: impl Fn(&str) -> Option<T>,
) -> Result<T, ClickHouseError> {
    f(s).ok_or_else(|| ClickHouseError::Decode {
        column,
        value: s.to_owned(),
    })
}

impl LogRow {
    /// The record and its `row_version`.
    pub fn into_record(self) -> Result<(RequestRecord, u64), ClickHouseError> {
        let input_bucket = match &self.input_bucket {
            None => None,
            Some(s) => Some(parse("input_bucket", s, InputBucket::parse)?),
        };
        let r = RequestRecord {
            endpoint: parse("endpoint", &self.endpoint, Endpoint::parse)?,
            outcome: parse("outcome", &self.outcome, Outcome::parse)?,
            input_tokens_source: parse(
                "input_tokens_source",
                &self.input_tokens_source,
                TokenSource::parse,
            )?,
            output_tokens_source: parse(
                "output_tokens_source",
                &self.output_tokens_source,
                TokenSource::parse,
            )?,
            queue_source: parse("queue_source", &self.queue_source, PhaseSource::parse)?,
            prefill_source: parse("prefill_source", &self.prefill_source, PhaseSource::parse)?,
            decode_source: parse("decode_source", &self.decode_source, PhaseSource::parse)?,
            input_bucket,
            request_id: self.request_id,
            trace_id: self.trace_id,
            created_at: self.created_at_us,
            model: self.model,
            model_served: self.model_served,
            upstream: self.upstream,
            user_id: self.user_id,
            tenant: self.tenant,
            business_line: self.business_line,
            request_type: self.request_type,
            api_key_id: self.api_key_id,
            stream: self.stream != 0,
            http_status: self.http_status,
            error_type: self.error_type,
            finish_reason: self.finish_reason,
            max_tokens: self.max_tokens,
            input_tokens: self.input_tokens,
            output_tokens: self.output_tokens,
            cached_tokens: self.cached_tokens,
            reasoning_tokens: self.reasoning_tokens,
            queue_duration_ms: self.queue_duration_ms,
            prefill_duration_ms: self.prefill_duration_ms,
            decode_duration_ms: self.decode_duration_ms,
            ttft_ms: self.ttft_ms,
            tpot_ms: self.tpot_ms,
            itl_max_ms: self.itl_max_ms,
            itl_mean_ms: self.itl_mean_ms,
            total_duration_ms: self.total_duration_ms,
            upstream_headers_ms: self.upstream_headers_ms,
            gateway_overhead_ms: self.gateway_overhead_ms,
            chunks: self.chunks,
            prompt_hash: self.prompt_hash,
            prompt_text: self.prompt_text,
            draft_tokens: self.draft_tokens,
            draft_accepted_tokens: self.draft_accepted_tokens,
            engine: self.engine,
            input_tokens_entry: self.input_tokens_entry,
            engine_running: self.engine_running,
            engine_waiting: self.engine_waiting,
            engine_kv_usage: self.engine_kv_usage,
            gpu_utilization: self.gpu_utilization,
            gpu_memory_bandwidth: self.gpu_memory_bandwidth,
            cost_usd: self.cost_usd,
            client_request_id: self.client_request_id,
            cache_creation_tokens: self.cache_creation_tokens,
            replica: self.replica,
            blocked_by_requests: self.blocked_by_requests,
            blocked_by_prompt_tokens: self.blocked_by_prompt_tokens,
            blocked_ms: self.blocked_ms,
            blocker_request_id: self.blocker_request_id,
            blocker_caller: self.blocker_caller,
            blocker_business_line: self.blocker_business_line,
            blocker_prompt_tokens: self.blocker_prompt_tokens,
            prompt_sketch: self.prompt_sketch,
            ttft_unaccounted_ms: self.ttft_unaccounted_ms,
            e2e_unaccounted_ms: self.e2e_unaccounted_ms,
            engine_timing: self.engine_timing,
        };
        Ok((r, self.row_version))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varint_lengths() {
        let mut b = Vec::new();
        put_str(&mut b, "");
        put_str(&mut b, &"x".repeat(127));
        assert_eq!(b[0], 0);
        assert_eq!(b[1], 127);
        let mut b = Vec::new();
        put_str(&mut b, &"x".repeat(300));
        assert_eq!(&b[..2], &[0xac, 0x02]);
        assert_eq!(b.len(), 302);
        let mut b = Vec::new();
        put_opt_str(&mut b, None);
        put_opt_u64(&mut b, Some(1));
        assert_eq!(b, [1, 0, 1, 0, 0, 0, 0, 0, 0, 0]);
    }
}
