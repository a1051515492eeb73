//! The fault matrix (issue 16, "do no harm"): every way a client, an engine, a disk or an
//! operator can hurt the gateway, each case stating the requests sent, the rows that must be in
//! the store afterwards and what the client saw — compared, where it applies, with the direct
//! path to the same engine.
//!
//! One module per area; each module's docs list its cases:
//! * `faults` — what held before the matrix existed: malformed request and response bodies,
//!   huge bodies, every mock-engine fault, dead upstreams, timeouts, client disconnects (one
//!   gateway, totals checked in the store after shutdown);
//! * `exhaustion` — connection floods, stalled headers / bodies / readers, header and
//!   attribution sizes, memory, admin work beside proxying;
//! * `shutdown` — SIGTERM with streams in flight and under load;
//! * `store` — client request ids, read-only store and spool, a deleted store file, a full disk;
//! * `admin` — tokens per route class, open admin, business-metric floods;
//! * `leaks` — passwords in logs, label bounds;
//! * `upstream` — pooled connection reuse after idle time, against the real llama.cpp and
//!   directly.
//!
//! The ClickHouse outage and SIGKILL-under-load cases need the ClickHouse harness and stay in
//! `clickhouse_store.rs` (`clickhouse_outage_of_30s_keeps_exactly_n_rows`,
//! `sigkill_under_load_then_restart_replays_every_spooled_record_once`).

mod admin;
#[path = "../common/mod.rs"]
mod common;
mod exhaustion;
mod faults;
mod leaks;
#[path = "../llama/mod.rs"]
mod llama; // (its own `#![allow(dead_code)]`; a second one here fails clippy)
mod shutdown;
mod store;
mod upstream;
