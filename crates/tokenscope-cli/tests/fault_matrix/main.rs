//! The fault matrix (issue 16, "do no harm"): every way a client, an engine, a disk or an
//! operator can hurt the gateway, each case stating the requests sent, the rows that must be in
//! the store afterwards and what the client saw — compared, where it applies, with the direct
//! path to the same engine.
//!
//! One module per area; each module's docs list its cases. Cases that already held before the
//! matrix existed (malformed input, huge bodies, mock faults, client disconnects, ClickHouse
//! outage, SIGKILL) live in `gateway_faults.rs`, `gateway_behaviour.rs` and
//! `clickhouse_store.rs` and keep running beside these.

#[path = "../common/mod.rs"]
mod common;
#[path = "../llama/mod.rs"]
#[allow(dead_code)]
mod llama;
mod upstream;
