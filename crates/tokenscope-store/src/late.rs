//! [`LateUpdates`]: late engine values ([`PhaseUpdate`]: OTLP spans from vLLM or SGLang,
//! joined to the gateway's records by trace id), decided once for every store.
//!
//! Who states what:
//! * the rule — what an update does to a record: engine counts replace estimates, never
//!   `usage` — is [`RequestRecord::apply_update`] (in `tokenscope-core`), and nothing else;
//! * sanitising is [`PhaseUpdate::sanitized`], merging two updates [`PhaseUpdate::merge`];
//! * the bounded, TTL-limited waiting room is [`PendingUpdates`];
//! * this module decides everything between them, and a store (the SQLite store, the
//!   ClickHouse sink) supplies only its I/O through [`LateRows`]: find the rows of some trace
//!   ids, write changed rows back.
//!
//! A batch of updates ([`LateUpdates::apply`]):
//! 1. waiting entries older than the TTL expire (counted);
//! 2. updates with an empty trace id are ignored; the others are merged into one update per
//!    trace id (arrival order; newer values win), on top of what already waited for it;
//! 3. the store finds the rows of those trace ids ([`LateRows::find`]);
//! 4. every row found gets its trace's merged update through the rule; the rows the rule
//!    changed are written back in one call ([`LateRows::write`], made even when nothing
//!    changed: that is where a store commits);
//! 5. only once that write succeeded, a trace id with at least one row counts as matched (its
//!    waiting entry is removed) and one without rows waits in the pending map. On an error
//!    nothing changed here: the caller may retry the same batch.
//!
//! A batch of new rows ([`LateUpdates::join`], insert, [`LateUpdates::inserted`]): every
//! record whose trace id has an update waiting gets it through the rule before it is
//! inserted; the waiting entry is removed only once the insert succeeded, so a failed batch
//! is retried with it.
//!
//! Invariants:
//! * A record only ever changes through [`RequestRecord::apply_update`]: no store restates the
//!   rule in its own language. A property test (this module's tests) drives the SQLite store
//!   and the in-memory path with the same random records and updates and checks that they
//!   end with identical records.
//! * Idempotent: applying a batch twice leaves the same rows.
//! * Every update is applied, merged into another one, or counted as unmatched
//!   ([`UnmatchedCounts`]: overflow, expired, shutdown; see [`crate::pending`]).
//! * The clock is passed in; the only I/O is the store's, through [`LateRows`].

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use tokenscope_core::{PhaseUpdate, RequestRecord};

use crate::pending::{PendingUpdates, UnmatchedCounts};

/// A store's rows, as late updates need them. See the module docs for when each is called.
pub trait LateRows {
    /// What the store needs to write a row back (SQLite: its `rowid`; ClickHouse: its row
    /// version).
    type Tag;
    /// The store's error.
    type Error;

    /// Every row whose trace id is one of `trace_ids` (that the store can still reach), each
    /// with its tag. Rows of other trace ids are ignored.
    fn find(&mut self, trace_ids: &[&str]) -> Result<Vec<(RequestRecord, Self::Tag)>, Self::Error>;

    /// Writes rows the rule changed back, with the tags `find` gave them; called once per
    /// batch, possibly with no rows. Once it returns `Ok`, the writes are durable.
    fn write(&mut self, changed: Vec<(RequestRecord, Self::Tag)>) -> Result<(), Self::Error>;
}

/// The shared late-update logic around one store's [`PendingUpdates`]. See the module docs.
#[derive(Debug, Default)]
pub struct LateUpdates {
    pending: PendingUpdates,
}

/// A batch of new records with the waiting updates joined in ([`LateUpdates::join`]).
#[derive(Debug)]
pub struct Joined<'a> {
    records: Cow<'a, [RequestRecord]>,
    /// `joined[i]`: record `i` got a waiting update (empty when none did).
    joined: Vec<bool>,
    /// Trace ids whose waiting update was joined.
    traces: Vec<String>,
}

impl Joined<'_> {
    /// The records to insert: the batch, with waiting updates applied.
    pub fn records(&self) -> &[RequestRecord] {
        &self.records
    }

    /// `true` when record `i` got a waiting update.
    pub fn is_joined(&self, i: usize) -> bool {
        self.joined.get(i).copied().unwrap_or(false)
    }
}

impl LateUpdates {
    /// Nothing waiting, the default limits of [`PendingUpdates`].
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the pending map's limits (see [`PendingUpdates::set_limits`]).
    pub fn set_limits(&mut self, capacity: usize, ttl: Duration) {
        self.pending.set_limits(capacity, ttl);
    }

    /// Updates waiting for their row.
    pub fn waiting(&self) -> usize {
        self.pending.len()
    }

    /// Expires waiting updates older than the TTL at `now` (counted).
    pub fn expire(&mut self, now: Instant) {
        self.pending.expire(now);
    }

    /// Applies a batch of updates to the rows `rows` finds, parking the others (steps 1–5 of
    /// the module docs). Returns how many trace ids found their row(s) now.
    pub fn apply<R: LateRows>(
        &mut self,
        updates: &[PhaseUpdate],
        rows: &mut R,
        now: Instant,
    ) -> Result<usize, R::Error> {
        self.pending.expire(now);
        let merged = self.merge_batch(updates);
        if merged.is_empty() {
            return Ok(0);
        }
        let mut matched = vec![false; merged.len()];
        let mut changed = Vec::new();
        {
            let index: HashMap<&str, usize> = merged
                .iter()
                .enumerate()
                .map(|(i, u)| (u.trace_id.as_str(), i))
                .collect();
            let ids: Vec<&str> = merged.iter().map(|u| u.trace_id.as_str()).collect();
            for (row, tag) in rows.find(&ids)? {
                let Some(&i) = index.get(row.trace_id.as_str()) else {
                    continue;
                };
                matched[i] = true;
                let mut updated = row.clone();
                updated.apply_update(&merged[i]);
                if updated != row {
                    changed.push((updated, tag));
                }
            }
        }
        rows.write(changed)?;
        let mut unmatched = Vec::new();
        let mut n = 0;
        // Matched entries leave first: parking the others may evict the oldest entry.
        for (u, hit) in merged.into_iter().zip(matched) {
            if hit {
                self.pending.take(&u.trace_id);
                n += 1;
            } else {
                unmatched.push(u);
            }
        }
        for u in unmatched {
            self.pending.insert(u, now);
        }
        Ok(n)
    }

    /// One update per trace id (first-arrival order), each merged on top of what already
    /// waits for it; empty trace ids dropped.
    fn merge_batch(&self, updates: &[PhaseUpdate]) -> Vec<PhaseUpdate> {
        let mut merged: Vec<PhaseUpdate> = Vec::new();
        let mut index: HashMap<&str, usize> = HashMap::new();
        for u in updates.iter().filter(|u| !u.trace_id.is_empty()) {
            match index.get(u.trace_id.as_str()) {
                Some(&i) => merged[i].merge(u),
                None => {
                    let mut m =
                        self.pending
                            .get(&u.trace_id)
                            .cloned()
                            .unwrap_or_else(|| PhaseUpdate {
                                trace_id: u.trace_id.clone(),
                                ..PhaseUpdate::default()
                            });
                    m.merge(u);
                    index.insert(&u.trace_id, merged.len());
                    merged.push(m);
                }
            }
        }
        merged
    }

    /// The batch with every waiting update applied to the records of its trace id (borrowed
    /// unchanged when nothing waits for them). Call [`Self::inserted`] once it is inserted.
    pub fn join<'a>(&self, batch: &'a [RequestRecord]) -> Joined<'a> {
        let mut joined = Joined {
            records: Cow::Borrowed(batch),
            joined: Vec::new(),
            traces: Vec::new(),
        };
        if self.pending.is_empty() {
            return joined;
        }
        let mut seen: HashSet<&str> = HashSet::new();
        for (i, r) in batch.iter().enumerate() {
            if r.trace_id.is_empty() {
                continue;
            }
            let Some(u) = self.pending.get(&r.trace_id) else {
                continue;
            };
            if joined.joined.is_empty() {
                joined.joined = vec![false; batch.len()];
            }
            joined.joined[i] = true;
            if let Some(rec) = joined.records.to_mut().get_mut(i) {
                rec.apply_update(u);
            }
            if seen.insert(&r.trace_id) {
                joined.traces.push(r.trace_id.clone());
            }
        }
        joined
    }

    /// The records of `joined` are stored: their waiting updates are done.
    pub fn inserted(&mut self, joined: &Joined<'_>) {
        for t in &joined.traces {
            self.pending.take(t);
        }
    }

    /// Updates given up on since the last call (expired at `now`, evicted on overflow; with
    /// `shutting_down`, every update still waiting, which is then forgotten).
    pub fn take_unmatched(&mut self, shutting_down: bool, now: Instant) -> UnmatchedCounts {
        self.pending.expire(now);
        if shutting_down {
            self.pending.drain_all();
        }
        self.pending.take_unmatched()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;

    use proptest::prelude::*;
    use tokenscope_core::{InputBucket, PhaseSource, TokenSource};

    use super::*;
    use crate::sqlite::tests::{full_record, sparse_record};
    use crate::SqliteStore;

    /// The in-memory store: rows in a vector, the tag is the index.
    #[derive(Default)]
    struct MemRows {
        rows: Vec<RequestRecord>,
    }

    impl LateRows for MemRows {
        type Tag = usize;
        type Error = Infallible;

        fn find(&mut self, ids: &[&str]) -> Result<Vec<(RequestRecord, usize)>, Infallible> {
            Ok(self
                .rows
                .iter()
                .enumerate()
                .filter(|(_, r)| ids.contains(&r.trace_id.as_str()))
                .map(|(i, r)| (r.clone(), i))
                .collect())
        }

        fn write(&mut self, changed: Vec<(RequestRecord, usize)>) -> Result<(), Infallible> {
            for (r, i) in changed {
                self.rows[i] = r;
            }
            Ok(())
        }
    }

    /// The in-memory path: [`LateUpdates`] over [`MemRows`], inserts ignoring known ids.
    #[derive(Default)]
    struct Memory {
        late: LateUpdates,
        store: MemRows,
    }

    impl Memory {
        fn insert(&mut self, batch: &[RequestRecord]) {
            let joined = self.late.join(batch);
            for r in joined.records() {
                if !self.store.rows.iter().any(|x| x.request_id == r.request_id) {
                    self.store.rows.push(r.clone());
                }
            }
            self.late.inserted(&joined);
        }

        fn update(&mut self, updates: &[PhaseUpdate]) -> usize {
            match self.late.apply(updates, &mut self.store, Instant::now()) {
                Ok(n) => n,
                Err(e) => match e {},
            }
        }
    }

    fn up(trace: &str, queue: Option<f64>, input: Option<u64>) -> PhaseUpdate {
        PhaseUpdate {
            trace_id: trace.to_owned(),
            queue_duration_ms: queue,
            input_tokens: input,
            ..PhaseUpdate::default()
        }
    }

    fn row(id: &str, trace: &str) -> RequestRecord {
        let mut r = sparse_record(id);
        r.trace_id = trace.to_owned();
        r
    }

    #[test]
    fn merged_batch_applies_once_and_unknown_traces_wait() {
        let mut m = Memory::default();
        m.insert(&[row("a", "t1")]);
        let n = m.update(&[
            up("t1", Some(1.0), Some(10)),
            up("t1", None, Some(20)),
            up("t2", Some(2.0), None),
            up("", Some(3.0), None),
        ]);
        assert_eq!(n, 1);
        // Merged first (newer wins), then applied once: the second count is the one stored.
        assert_eq!(m.store.rows[0].input_tokens, Some(20));
        assert_eq!(m.store.rows[0].queue_duration_ms, Some(1.0));
        assert_eq!(m.late.waiting(), 1);
        // A later engine count never replaces the first engine one.
        m.update(&[up("t1", None, Some(30))]);
        assert_eq!(m.store.rows[0].input_tokens, Some(20));
        // The waiting one is joined on insert, to every record of its trace in the batch.
        m.insert(&[row("b", "t2"), row("c", "t2"), row("d", "t3")]);
        assert_eq!(m.late.waiting(), 0);
        assert_eq!(m.store.rows[1].queue_duration_ms, Some(2.0));
        assert_eq!(m.store.rows[2].queue_source, PhaseSource::EngineSpan);
        assert_eq!(m.store.rows[3].queue_duration_ms, None);
        assert_eq!(
            m.late.take_unmatched(true, Instant::now()),
            UnmatchedCounts::default()
        );
    }

    #[test]
    fn join_borrows_when_nothing_waits_and_marks_joined_records() {
        let mut late = LateUpdates::new();
        let batch = [row("a", "t1"), row("b", "t2")];
        let j = late.join(&batch);
        assert!(matches!(j.records, Cow::Borrowed(_)));
        assert!(!j.is_joined(0));
        late.apply(
            &[up("t2", Some(1.0), None)],
            &mut MemRows::default(),
            Instant::now(),
        )
        .unwrap_or_else(|e| match e {});
        let j = late.join(&batch);
        assert!(!j.is_joined(0) && j.is_joined(1));
        assert_eq!(j.records()[1].queue_duration_ms, Some(1.0));
        assert_eq!(late.waiting(), 1);
        late.inserted(&j);
        assert_eq!(late.waiting(), 0);
    }

    /// A store whose write fails: nothing is matched or parked.
    struct Failing(MemRows);

    impl LateRows for Failing {
        type Tag = usize;
        type Error = ();
        fn find(&mut self, ids: &[&str]) -> Result<Vec<(RequestRecord, usize)>, ()> {
            self.0.find(ids).map_err(|e| match e {})
        }
        fn write(&mut self, _: Vec<(RequestRecord, usize)>) -> Result<(), ()> {
            Err(())
        }
    }

    #[test]
    fn a_failed_write_changes_nothing_waiting() {
        let mut late = LateUpdates::new();
        let now = Instant::now();
        let mut rows = Failing(MemRows {
            rows: vec![row("a", "t1")],
        });
        assert!(late
            .apply(
                &[up("t1", Some(1.0), None), up("t2", Some(1.0), None)],
                &mut rows,
                now
            )
            .is_err());
        assert_eq!(late.waiting(), 0);
        late.set_limits(1, Duration::from_secs(1));
        let mut ok = MemRows::default();
        for t in ["t1", "t2"] {
            late.apply(&[up(t, None, None)], &mut ok, now)
                .unwrap_or_else(|e| match e {});
        }
        let u = late.take_unmatched(false, now + Duration::from_secs(1));
        assert_eq!((u.overflow, u.expired), (1, 1));
    }

    /// The naive reference: rows in a vector, pending in a map, every step spelled out.
    #[derive(Default)]
    struct Oracle {
        rows: Vec<RequestRecord>,
        pending: HashMap<String, PhaseUpdate>,
    }

    impl Oracle {
        fn insert(&mut self, batch: &[RequestRecord]) {
            for r in batch {
                if self.rows.iter().any(|x| x.request_id == r.request_id) {
                    continue;
                }
                let mut r = r.clone();
                if let Some(u) = self.pending.get(&r.trace_id) {
                    r.apply_update(u);
                }
                self.rows.push(r);
            }
            for r in batch {
                self.pending.remove(&r.trace_id);
            }
        }

        fn update(&mut self, batch: &[PhaseUpdate]) -> usize {
            let mut merged: Vec<PhaseUpdate> = Vec::new();
            for u in batch.iter().filter(|u| !u.trace_id.is_empty()) {
                match merged.iter_mut().find(|m| m.trace_id == u.trace_id) {
                    Some(m) => m.merge(u),
                    None => {
                        let mut m = self
                            .pending
                            .get(&u.trace_id)
                            .cloned()
                            .unwrap_or(PhaseUpdate {
                                trace_id: u.trace_id.clone(),
                                ..PhaseUpdate::default()
                            });
                        m.merge(u);
                        merged.push(m);
                    }
                }
            }
            let mut n = 0;
            for m in merged {
                let mut hit = false;
                for r in self.rows.iter_mut().filter(|r| r.trace_id == m.trace_id) {
                    r.apply_update(&m);
                    hit = true;
                }
                if hit {
                    self.pending.remove(&m.trace_id);
                    n += 1;
                } else {
                    self.pending.insert(m.trace_id.clone(), m);
                }
            }
            n
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(Vec<RequestRecord>),
        Update(Vec<PhaseUpdate>),
    }

    const TRACES: usize = 5;

    fn trace(i: usize) -> String {
        format!("{:032x}", 0x4bf9_2f35_77b3_4da6_u128 << 64 | i as u128)
    }

    fn token_source() -> impl Strategy<Value = TokenSource> {
        prop_oneof![
            Just(TokenSource::Usage),
            Just(TokenSource::Engine),
            Just(TokenSource::Tokenizer),
            Just(TokenSource::Chunks),
            Just(TokenSource::Estimate),
            Just(TokenSource::None),
        ]
    }

    fn phase_source() -> impl Strategy<Value = PhaseSource> {
        prop_oneof![
            Just(PhaseSource::Engine),
            Just(PhaseSource::EngineSpan),
            Just(PhaseSource::Derived),
            Just(PhaseSource::None),
        ]
    }

    /// What a store can hold: finite durations, counts up to `i64::MAX`.
    fn stored_ms() -> impl Strategy<Value = Option<f64>> {
        prop::option::of(prop_oneof![0.0..1e6_f64, Just(0.0), Just(12.5)])
    }

    fn stored_tokens() -> impl Strategy<Value = Option<u64>> {
        prop::option::of(prop_oneof![0..5_000_u64, Just(i64::MAX as u64)])
    }

    /// What an engine may send: also NaN, infinities, negatives, absurd counts.
    fn sent_ms() -> impl Strategy<Value = Option<f64>> {
        prop::option::of(prop_oneof![
            4 => 0.0..1e5_f64,
            1 => Just(f64::NAN),
            1 => Just(f64::INFINITY),
            1 => Just(f64::NEG_INFINITY),
            1 => -1e3..-1e-9_f64,
            1 => Just(-0.0),
            1 => Just(1e300),
        ])
    }

    fn sent_tokens() -> impl Strategy<Value = Option<u64>> {
        prop::option::of(prop_oneof![
            4 => 0..5_000_u64,
            1 => Just(u64::MAX),
            1 => Just(i64::MAX as u64),
            1 => Just(i64::MAX as u64 + 1),
        ])
    }

    prop_compose! {
        fn record()(
            full in any::<bool>(),
            t in 0..TRACES,
            created_at in 1_700_000_000_000_000_i64..1_700_000_000_100_000,
            input in stored_tokens(),
            output in stored_tokens(),
            in_src in token_source(),
            out_src in token_source(),
            bucket in prop::option::of(prop::sample::select(InputBucket::ALL.to_vec())),
            phases in (stored_ms(), stored_ms(), stored_ms()),
            sources in (phase_source(), phase_source(), phase_source()),
        ) -> RequestRecord {
            let mut r = if full { full_record("") } else { sparse_record("") };
            r.trace_id = trace(t);
            r.created_at = created_at;
            r.input_tokens = input;
            r.output_tokens = output;
            r.input_tokens_source = in_src;
            r.output_tokens_source = out_src;
            r.input_bucket = bucket;
            (r.queue_duration_ms, r.prefill_duration_ms, r.decode_duration_ms) = phases;
            (r.queue_source, r.prefill_source, r.decode_source) = sources;
            r
        }
    }

    prop_compose! {
        fn update()(
            t in prop::option::weighted(0.95, 0..TRACES),
            queue in sent_ms(),
            prefill in sent_ms(),
            decode in sent_ms(),
            input in sent_tokens(),
            output in sent_tokens(),
            per_step in prop::bool::weighted(0.2),
        ) -> PhaseUpdate {
            PhaseUpdate {
                trace_id: t.map(trace).unwrap_or_default(),
                queue_duration_ms: queue,
                prefill_duration_ms: prefill,
                decode_duration_ms: decode,
                input_tokens: input,
                output_tokens: output,
                per_step,
            }
        }
    }

    fn ops() -> impl Strategy<Value = Vec<Op>> {
        let op = prop_oneof![
            prop::collection::vec(record(), 1..4).prop_map(Op::Insert),
            prop::collection::vec(update(), 0..5).prop_map(Op::Update),
        ];
        prop::collection::vec(op, 1..12).prop_map(|mut ops| {
            // Unique request ids, in order.
            let mut n = 0;
            for op in &mut ops {
                if let Op::Insert(batch) = op {
                    for r in batch {
                        n += 1;
                        r.request_id = format!("r{n:03}");
                        r.client_request_id = r.client_request_id.as_ref().map(|_| format!("c{n}"));
                    }
                }
            }
            ops
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(256))]

        /// The SQLite store (reads rows, applies the rule, writes them back, joins on insert)
        /// and the in-memory path end with the same records, the same waiting updates and the
        /// same match counts as a naive reference, whatever arrives in whichever order.
        #[test]
        fn sqlite_and_in_memory_paths_agree(ops in ops()) {
            let mut sqlite = SqliteStore::open_in_memory().expect("open");
            let mut memory = Memory::default();
            let mut oracle = Oracle::default();
            for op in &ops {
                match op {
                    Op::Insert(batch) => {
                        sqlite.insert_batch(batch).expect("insert");
                        memory.insert(batch);
                        oracle.insert(batch);
                    }
                    Op::Update(batch) => {
                        let want = oracle.update(batch);
                        prop_assert_eq!(sqlite.apply_updates(batch).expect("update"), want);
                        prop_assert_eq!(memory.update(batch), want);
                    }
                }
                prop_assert_eq!(sqlite.pending_updates(), oracle.pending.len());
                prop_assert_eq!(memory.late.waiting(), oracle.pending.len());
            }
            prop_assert_eq!(&memory.store.rows, &oracle.rows);
            prop_assert_eq!(sqlite.count().expect("count"), oracle.rows.len() as u64);
            for want in &oracle.rows {
                let got = sqlite.get(&want.request_id).expect("get");
                prop_assert_eq!(got.as_ref(), Some(want));
            }
            let unmatched = UnmatchedCounts { shutdown: oracle.pending.len() as u64, ..UnmatchedCounts::default() };
            prop_assert_eq!(sqlite.take_unmatched(true), unmatched);
            prop_assert_eq!(memory.late.take_unmatched(true, Instant::now()), unmatched);
        }
    }
}
