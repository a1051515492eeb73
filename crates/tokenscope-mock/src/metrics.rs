//! Engine gauges and counters, rendered as Prometheus text with both llama.cpp and vLLM names.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Live engine state shared between the engine task, the handlers and `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct Stats {
    /// Requests occupying a slot.
    pub running: AtomicUsize,
    /// Requests submitted and not yet admitted (including ones still in the submission channel).
    pub waiting: AtomicUsize,
    /// Prompt tokens prefilled, all requests.
    pub prompt_tokens: AtomicU64,
    /// Tokens generated, all requests.
    pub generated_tokens: AtomicU64,
    /// Requests finished (not aborted).
    pub finished: AtomicU64,
    /// Requests aborted because their client went away.
    pub aborted: AtomicU64,
    /// KV tokens held by running sequences (only maintained with a KV model).
    pub kv_used: AtomicU64,
}

impl Stats {
    /// Prometheus text exposition (format 0.0.4).
    /// `kv_tokens` is the KV capacity (0 = no KV model: occupied slots / slots stands in).
    pub(crate) fn render(&self, model: &str, slots: usize, kv_tokens: u64) -> String {
        let running = self.running.load(Ordering::Relaxed);
        let waiting = self.waiting.load(Ordering::Relaxed);
        let prompt = self.prompt_tokens.load(Ordering::Relaxed);
        let generated = self.generated_tokens.load(Ordering::Relaxed);
        let finished = self.finished.load(Ordering::Relaxed);
        let aborted = self.aborted.load(Ordering::Relaxed);
        // The mock has no KV cache: occupied slots / slots stands in for cache usage.
        let kv = if kv_tokens > 0 {
            (self.kv_used.load(Ordering::Relaxed) as f64 / kv_tokens as f64).min(1.0)
        } else if slots == 0 {
            0.0
        } else {
            running as f64 / slots as f64
        };
        let label = format!("{{model_name=\"{}\"}}", escape_label(model));
        let mut out = String::with_capacity(2048);
        let mut metric = |name: &str, kind: &str, help: &str, labels: &str, value: String| {
            // Writing to a String cannot fail.
            let _ = write!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{labels} {value}\n"
            );
        };
        // llama.cpp names.
        metric(
            "llamacpp:requests_processing",
            "gauge",
            "Number of requests processing.",
            "",
            running.to_string(),
        );
        metric(
            "llamacpp:requests_deferred",
            "gauge",
            "Number of requests deferred.",
            "",
            waiting.to_string(),
        );
        metric(
            "llamacpp:prompt_tokens_total",
            "counter",
            "Number of prompt tokens processed.",
            "",
            prompt.to_string(),
        );
        metric(
            "llamacpp:tokens_predicted_total",
            "counter",
            "Number of generation tokens processed.",
            "",
            generated.to_string(),
        );
        metric(
            "llamacpp:kv_cache_usage_ratio",
            "gauge",
            "KV-cache usage. Mock: KV tokens held / capacity with --kv-tokens, else occupied slots / slots.",
            "",
            kv.to_string(),
        );
        // vLLM names, same state.
        metric(
            "vllm:num_requests_running",
            "gauge",
            "Number of requests in model execution batches.",
            &label,
            running.to_string(),
        );
        metric(
            "vllm:num_requests_waiting",
            "gauge",
            "Number of requests waiting to be processed.",
            &label,
            waiting.to_string(),
        );
        metric(
            "vllm:kv_cache_usage_perc",
            "gauge",
            "KV-cache usage, 1 means 100 percent. Mock: KV tokens held / capacity with --kv-tokens, else occupied slots / slots.",
            &label,
            kv.to_string(),
        );
        metric(
            "vllm:prompt_tokens_total",
            "counter",
            "Number of prefill tokens processed.",
            &label,
            prompt.to_string(),
        );
        metric(
            "vllm:generation_tokens_total",
            "counter",
            "Number of generation tokens processed.",
            &label,
            generated.to_string(),
        );
        // The mock's own.
        metric(
            "tokenscope_mock_requests_finished_total",
            "counter",
            "Requests that ran to completion.",
            "",
            finished.to_string(),
        );
        metric(
            "tokenscope_mock_requests_aborted_total",
            "counter",
            "Requests aborted because the client disconnected.",
            "",
            aborted.to_string(),
        );
        out
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_both_namings() {
        let s = Stats::default();
        s.running.store(3, Ordering::Relaxed);
        s.waiting.store(2, Ordering::Relaxed);
        let text = s.render("m\"x", 4, 0);
        assert!(text.contains("llamacpp:requests_processing 3\n"));
        assert!(text.contains("llamacpp:requests_deferred 2\n"));
        assert!(text.contains("vllm:num_requests_running{model_name=\"m\\\"x\"} 3\n"));
        assert!(text.contains("vllm:num_requests_waiting{model_name=\"m\\\"x\"} 2\n"));
        assert!(text.contains("vllm:kv_cache_usage_perc{model_name=\"m\\\"x\"} 0.75\n"));
        assert!(text.contains("# TYPE llamacpp:prompt_tokens_total counter\n"));
    }

    #[test]
    fn kv_model_reports_used_over_capacity() {
        let s = Stats::default();
        s.running.store(1, Ordering::Relaxed);
        s.kv_used.store(950, Ordering::Relaxed);
        let text = s.render("m", 8, 1000);
        assert!(
            text.contains("llamacpp:kv_cache_usage_ratio 0.95\n"),
            "{text}"
        );
        assert!(text.contains("vllm:kv_cache_usage_perc{model_name=\"m\"} 0.95\n"));
        // Generation past the capacity is reported as full, never above 1.
        s.kv_used.store(1200, Ordering::Relaxed);
        assert!(s
            .render("m", 8, 1000)
            .contains("llamacpp:kv_cache_usage_ratio 1\n"));
    }
}
