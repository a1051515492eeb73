//! The upstream replicas' metrics: outstanding requests, health and ejections per replica.
//!
//! | metric | type | labels |
//! |---|---|---|
//! | `tokenscope_upstream_outstanding_requests` | gauge | `upstream`, `replica` |
//! | `tokenscope_upstream_replica_healthy` | gauge (1 healthy, 0 ejected or awaiting its probe) | `upstream`, `replica` |
//! | `tokenscope_upstream_ejections_total` | counter | `upstream`, `replica` |
//!
//! Invariants:
//! * Labels are bounded: `upstream` is a configured name and `replica` the `host:port` of a
//!   configured URL; the series are created once at start-up ([`ReplicaMetricsFamilies::replica`])
//!   and their handles kept by the gateway, so the request path never looks a label set up.
//! * Every series exists from the start (0 outstanding, healthy, 0 ejections).

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// `{upstream, replica}`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReplicaLabels {
    /// The upstream's configured name.
    pub upstream: String,
    /// The replica's `host:port`.
    pub replica: String,
}

/// The three families, registered once.
#[derive(Clone, Debug, Default)]
pub struct ReplicaMetricsFamilies {
    outstanding: Family<ReplicaLabels, Gauge>,
    healthy: Family<ReplicaLabels, Gauge>,
    ejections: Family<ReplicaLabels, Counter>,
}

/// One replica's series (cheap clones of shared atomics).
#[derive(Clone, Debug, Default)]
pub struct ReplicaMetrics {
    /// Requests sent to the replica whose response has not ended yet.
    pub outstanding: Gauge,
    /// 1 while the replica takes requests, 0 while it is ejected or awaiting its probe.
    pub healthy: Gauge,
    /// Times the replica was ejected (a refused or timed-out connection, a response head
    /// that did not come in time, a failed probe).
    pub ejections: Counter,
}

impl ReplicaMetricsFamilies {
    /// Registers the families in `registry`.
    pub fn register(registry: &mut Registry) -> Self {
        let f = Self::default();
        registry.register(
            "tokenscope_upstream_outstanding_requests",
            "Requests sent to an upstream replica whose response has not ended (streams count until their end)",
            f.outstanding.clone(),
        );
        registry.register(
            "tokenscope_upstream_replica_healthy",
            "1 while an upstream replica takes requests, 0 while it is ejected or awaiting its probe",
            f.healthy.clone(),
        );
        registry.register(
            "tokenscope_upstream_ejections",
            "Ejections of an upstream replica (connection refused or timed out, response head timeout, failed probe)",
            f.ejections.clone(),
        );
        f
    }

    /// The series of one replica, created now (healthy, nothing outstanding).
    pub fn replica(&self, upstream: &str, replica: &str) -> ReplicaMetrics {
        let labels = ReplicaLabels {
            upstream: upstream.to_owned(),
            replica: replica.to_owned(),
        };
        let m = ReplicaMetrics {
            outstanding: self.outstanding.get_or_create(&labels).clone(),
            healthy: self.healthy.get_or_create(&labels).clone(),
            ejections: self.ejections.get_or_create(&labels).clone(),
        };
        m.healthy.set(1);
        m
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn series_exist_from_the_start_and_share_their_values() {
        let mut registry = Registry::default();
        let f = ReplicaMetricsFamilies::register(&mut registry);
        let a = f.replica("pool", "a:1");
        let _b = f.replica("pool", "b:2");
        a.outstanding.inc();
        a.ejections.inc();
        a.healthy.set(0);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        for line in [
            "tokenscope_upstream_outstanding_requests{upstream=\"pool\",replica=\"a:1\"} 1",
            "tokenscope_upstream_outstanding_requests{upstream=\"pool\",replica=\"b:2\"} 0",
            "tokenscope_upstream_replica_healthy{upstream=\"pool\",replica=\"a:1\"} 0",
            "tokenscope_upstream_replica_healthy{upstream=\"pool\",replica=\"b:2\"} 1",
            "tokenscope_upstream_ejections_total{upstream=\"pool\",replica=\"a:1\"} 1",
            "tokenscope_upstream_ejections_total{upstream=\"pool\",replica=\"b:2\"} 0",
        ] {
            assert!(text.contains(line), "{line} missing in\n{text}");
        }
    }
}
