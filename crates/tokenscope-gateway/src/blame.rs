//! Per-request blame: what each request waited behind on its replica.
//!
//! The gateway sees every request it sends to each upstream replica. Each [`Replica`] keeps a
//! [`Board`] of them; a request enters it when it is sent to the replica ([`Board::enter`])
//! and leaves it when its record is finished ([`Ticket::leave`]), which computes its
//! [`Blame`].
//!
//! ## Definitions
//!
//! * A request's **wait** is `[sent, wait_end)`: from the instant it was sent to the replica
//!   to its first output token (streamed), or to `sent + queue + prefill` where the engine
//!   reported both (not streamed); otherwise it has no known wait and no blame (`None`).
//! * Another request is **in prefill** from its own `sent` to its first output token; one
//!   that never streamed a token is in prefill until `sent + queue + prefill` when the engine
//!   reported both, else until its end; one still in flight without a first token is in
//!   prefill still.
//! * Its **blockers** are the other requests of the same replica whose prefill overlaps its
//!   wait. [`Blame::requests`] counts them, [`Blame::prompt_tokens`] sums their prompt
//!   tokens, [`Blame::blocked_ms`] is the length of the part of the wait covered by the union
//!   of their prefills, and [`Blame::top`] is the blocker with the most prompt tokens (ties:
//!   the earliest sent).
//! * A blocker's **prompt tokens** are the engine's `input_tokens` once it has finished, else
//!   the gateway's entry estimate from the prompt's length (a blocker still in flight).
//!
//! ## Invariants
//!
//! * Nothing here does I/O. One short `parking_lot` lock per replica, taken twice per
//!   request (enter, leave); the first token is an atomic store, no lock.
//! * Bounded: the requests in flight, plus at most [`ENDED_CAP`] finished ones per replica,
//!   kept in the order they finished. A leave scans the in-flight ones and the finished ones
//!   newest first, stopping at the first that ended before the leaving request was sent
//!   (none older can overlap its wait).
//! * A ticket dropped without [`Ticket::leave`] (the request was retried on another
//!   replica) removes its request from the board without leaving a trace there.
//!
//! ## Per-step engine numbers
//!
//! An engine that stamps its per-request times at step boundaries (vLLM's per-request
//! `metrics`: scheduled / first token / last token are taken once per engine step) gives
//! every request of one step the same values. A leaving request whose engine-reported prefill
//! and decode ([`StepKey`]) are bit-identical to those of a request that finished on the same
//! replica while it was in flight was timed per step, not per request: [`Ticket::leave_step`]
//! says so ([`StepMates::per_step`]) and names the trace ids of the earlier requests of that
//! step not yet named ([`StepMates::flag`]; each is named once), so that their records are
//! marked too (a late update). Only engine-reported values take part (a value the gateway
//! derived is not the engine's), and a zero prefill never does.
//!
//! [`Replica`]: crate::replicas::Replica

use parking_lot::Mutex;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Finished requests kept per replica for the blame of the requests still in flight.
pub(crate) const ENDED_CAP: usize = 4096;

/// Who a request is, as a blocker.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct Who {
    /// The gateway's request id.
    pub request_id: String,
    /// `user_id`, else `key:<api_key_id>`, else `tenant:<tenant>`.
    pub caller: Option<String>,
    /// Its business line.
    pub business_line: Option<String>,
}

/// What a request waited behind. See the module docs.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct Blame {
    /// Blockers.
    pub requests: u64,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// The part of the wait covered by their prefills, ms.
    pub blocked_ms: f64,
    /// The largest blocker and its prompt tokens.
    pub top: Option<(Who, u64)>,
}

struct Slot {
    who: Who,
    sent: Instant,
    /// Entry estimate while in flight; the engine's count once finished.
    prompt_tokens: AtomicU64,
    /// 0: none yet; else nanoseconds from `sent` to the first token, plus one.
    first_token: AtomicU64,
}

impl Slot {
    fn first_token(&self) -> Option<Instant> {
        match self.first_token.load(Ordering::Acquire) {
            0 => None,
            n => Some(self.sent + Duration::from_nanos(n - 1)),
        }
    }
}

struct Ended {
    slot: Arc<Slot>,
    prefill_end: Instant,
    end: Instant,
    /// Its engine-reported prefill and decode, and its trace id.
    step: Option<(StepKey, Option<String>)>,
    /// Already found to share its step with another request.
    per_step: bool,
}

/// A request's engine-reported prefill and decode, as bits (`f64::to_bits`; decode 0 when
/// the engine reported none): two requests with the same key were timed per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StepKey {
    pub prefill_bits: u64,
    pub decode_bits: u64,
}

impl StepKey {
    /// The key of an engine-reported prefill (> 0) and decode; `None` without a prefill.
    pub(crate) fn of(prefill_ms: Option<f64>, decode_ms: Option<f64>) -> Option<StepKey> {
        let p = prefill_ms.filter(|p| p.is_finite() && *p > 0.0)?;
        Some(StepKey {
            prefill_bits: p.to_bits(),
            decode_bits: decode_ms.filter(|d| d.is_finite()).map_or(0, f64::to_bits),
        })
    }
}

/// What [`Ticket::leave_step`] found about the leaving request's engine numbers.
#[derive(Debug, Clone, PartialEq, Default)]
pub(crate) struct StepMates {
    /// Its engine values equal another overlapping request's: per step, not per request.
    pub per_step: bool,
    /// Trace ids of the earlier requests of the same step not named before.
    pub flag: Vec<String>,
}

#[derive(Default)]
struct Inner {
    next: u64,
    active: HashMap<u64, Arc<Slot>>,
    ended: VecDeque<Ended>,
}

/// The requests in flight on one replica, and the last ones finished there.
#[derive(Default)]
pub(crate) struct Board {
    inner: Mutex<Inner>,
}

impl Board {
    /// `who` was sent to this replica at `sent`, with a prompt estimated at `prompt_tokens`.
    pub(crate) fn enter(self: &Arc<Self>, who: Who, prompt_tokens: u64, sent: Instant) -> Ticket {
        let slot = Arc::new(Slot {
            who,
            sent,
            prompt_tokens: AtomicU64::new(prompt_tokens),
            first_token: AtomicU64::new(0),
        });
        let mut g = self.inner.lock();
        let id = g.next;
        g.next = g.next.wrapping_add(1);
        g.active.insert(id, slot.clone());
        drop(g);
        Ticket {
            board: Some(self.clone()),
            id,
            slot,
        }
    }

    /// Requests in flight (tests, metrics).
    #[cfg(test)]
    fn in_flight(&self) -> usize {
        self.inner.lock().active.len()
    }
}

/// A request's place on its replica's [`Board`].
pub(crate) struct Ticket {
    board: Option<Arc<Board>>,
    id: u64,
    slot: Arc<Slot>,
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("request_id", &self.slot.who.request_id)
            .finish()
    }
}

impl Ticket {
    /// Its first output token arrived at `at` (the first call counts).
    pub(crate) fn first_token(&self, at: Instant) {
        let n = at.saturating_duration_since(self.slot.sent).as_nanos();
        let n = u64::try_from(n).unwrap_or(u64::MAX - 1).saturating_add(1);
        let _ = self
            .slot
            .first_token
            .compare_exchange(0, n, Ordering::AcqRel, Ordering::Acquire);
    }

    /// The instant it was sent to the replica.
    pub(crate) fn sent(&self) -> Instant {
        self.slot.sent
    }

    /// [`Self::leave_step`] without engine values (tests).
    #[cfg(test)]
    pub(crate) fn leave(
        self,
        engine_prefill_end: Option<Instant>,
        input_tokens: Option<u64>,
        end: Instant,
    ) -> Option<Blame> {
        self.leave_step(engine_prefill_end, input_tokens, end, None)
            .0
    }

    /// The request finished at `end`. `engine_prefill_end` is `sent + queue + prefill` where
    /// the engine reported both; `input_tokens` its prompt tokens as finally counted; `step`
    /// its engine-reported prefill / decode and trace id. Returns its blame (`None` when its
    /// wait has no known end) and its step mates (module docs).
    pub(crate) fn leave_step(
        mut self,
        engine_prefill_end: Option<Instant>,
        input_tokens: Option<u64>,
        end: Instant,
        step: Option<(StepKey, Option<String>)>,
    ) -> (Option<Blame>, StepMates) {
        let Some(board) = self.board.take() else {
            return (None, StepMates::default());
        };
        let slot = self.slot.clone();
        if let Some(t) = input_tokens {
            slot.prompt_tokens.store(t, Ordering::Relaxed);
        }
        let first = slot.first_token();
        let wait_end = first.or(engine_prefill_end);
        let prefill_end = first.or(engine_prefill_end).unwrap_or(end).min(end);
        let mut g = board.inner.lock();
        g.active.remove(&self.id);
        let blame = wait_end.map(|w| blame_of(&g, &slot, w.max(slot.sent)));
        let mates = match &step {
            Some((key, _)) => step_mates(&mut g, slot.sent, *key),
            None => StepMates::default(),
        };
        if g.ended.len() >= ENDED_CAP {
            g.ended.pop_front();
        }
        g.ended.push_back(Ended {
            slot,
            prefill_end,
            end,
            step,
            per_step: mates.per_step,
        });
        drop(g);
        (blame, mates)
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        if let Some(board) = self.board.take() {
            board.inner.lock().active.remove(&self.id);
        }
    }
}

/// The finished requests that overlapped `[sent, now)` with the same engine values as `key`
/// (module docs); marks them named.
fn step_mates(g: &mut Inner, sent: Instant, key: StepKey) -> StepMates {
    let mut m = StepMates::default();
    for e in g.ended.iter_mut().rev() {
        if e.end <= sent {
            break;
        }
        let Some((k, trace)) = &e.step else {
            continue;
        };
        if *k != key {
            continue;
        }
        m.per_step = true;
        if !e.per_step {
            e.per_step = true;
            if let Some(t) = trace {
                m.flag.push(t.clone());
            }
        }
    }
    m
}

/// The blame of `me`, whose wait is `[me.sent, wait_end)`, against the board's requests.
fn blame_of(g: &Inner, me: &Arc<Slot>, wait_end: Instant) -> Blame {
    let start = me.sent;
    let mut spans: Vec<(Instant, Instant)> = Vec::new();
    let mut b = Blame::default();
    let mut consider = |slot: &Arc<Slot>, prefill_end: Instant| {
        if Arc::ptr_eq(slot, me) || slot.sent >= wait_end || prefill_end <= start {
            return;
        }
        let tokens = slot.prompt_tokens.load(Ordering::Relaxed);
        b.requests += 1;
        b.prompt_tokens = b.prompt_tokens.saturating_add(tokens);
        spans.push((slot.sent.max(start), prefill_end.min(wait_end)));
        let better = match &b.top {
            None => true,
            Some((_, t)) => tokens > *t,
        };
        if better {
            b.top = Some((slot.who.clone(), tokens));
        }
    };
    // In flight: in prefill until their first token (still, when none yet).
    let mut active: Vec<&Arc<Slot>> = g.active.values().collect();
    // Deterministic ties (earliest sent wins): visit in sending order.
    active.sort_by_key(|s| s.sent);
    let mut ended: Vec<(&Arc<Slot>, Instant)> = Vec::new();
    for e in g.ended.iter().rev() {
        if e.end <= start {
            break;
        }
        ended.push((&e.slot, e.prefill_end));
    }
    let mut all: Vec<(&Arc<Slot>, Instant)> = active
        .into_iter()
        .map(|s| (s, s.first_token().unwrap_or(wait_end)))
        .chain(ended)
        .collect();
    all.sort_by_key(|(s, _)| s.sent);
    for (s, pe) in all {
        consider(s, pe);
    }
    spans.sort_unstable();
    let mut covered = Duration::ZERO;
    let mut cur: Option<(Instant, Instant)> = None;
    for (s, e) in spans {
        match cur {
            Some((cs, ce)) if s <= ce => cur = Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                covered += ce.saturating_duration_since(cs);
                cur = Some((s, e));
            }
            None => cur = Some((s, e)),
        }
    }
    if let Some((cs, ce)) = cur {
        covered += ce.saturating_duration_since(cs);
    }
    b.blocked_ms = covered.as_secs_f64() * 1000.0;
    b
}

/// A record's caller as the blame names it: `user_id`, else `key:<api_key_id>`, else
/// `tenant:<tenant>` (the anomaly detector's caller).
pub(crate) fn caller_of(rec: &tokenscope_core::RequestRecord) -> Option<String> {
    rec.user_id
        .clone()
        .or_else(|| rec.api_key_id.as_ref().map(|k| format!("key:{k}")))
        .or_else(|| rec.tenant.as_ref().map(|t| format!("tenant:{t}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn who(id: &str) -> Who {
        Who {
            request_id: id.to_owned(),
            caller: Some(format!("caller-{id}")),
            business_line: Some("line".to_owned()),
        }
    }

    fn ms(t0: Instant, n: u64) -> Instant {
        t0 + Duration::from_millis(n)
    }

    #[test]
    fn a_short_request_arriving_during_a_long_prefill_names_it() {
        let board = Arc::new(Board::default());
        let t0 = Instant::now();
        // long: sent at 0, first token at 1000, ends at 1500.
        let long = board.enter(who("long"), 1500, t0);
        // short A: sent at 200, first token at 1100; short B: sent at 300, first at 1100.
        let a = board.enter(who("a"), 10, ms(t0, 200));
        let b = board.enter(who("b"), 12, ms(t0, 300));
        long.first_token(ms(t0, 1000));
        a.first_token(ms(t0, 1100));
        b.first_token(ms(t0, 1100));
        let ba = a.leave(None, Some(11), ms(t0, 1200)).expect("blame");
        // Blockers of A: long (prefill 0..1000) and B (300..1100).
        assert_eq!(ba.requests, 2);
        assert_eq!(ba.prompt_tokens, 1500 + 12);
        let (top, tokens) = ba.top.expect("top");
        assert_eq!((top.request_id.as_str(), tokens), ("long", 1500));
        assert_eq!(top.caller.as_deref(), Some("caller-long"));
        // Covered: 200..1100 (long 200..1000 ∪ B 300..1100).
        assert!((ba.blocked_ms - 900.0).abs() < 1e-6, "{}", ba.blocked_ms);
        // The long one finishes with its engine count; B still sees it (ended after B sent)
        // and A (ended, its prefill 200..1100), with A's final count.
        let bl = long.leave(None, Some(1503), ms(t0, 1500)).expect("blame");
        assert_eq!(bl.requests, 2, "A and B were in prefill during its wait");
        let bb = b.leave(None, None, ms(t0, 1600)).expect("blame");
        assert_eq!(bb.requests, 2);
        assert_eq!(bb.prompt_tokens, 1503 + 11);
        assert_eq!(bb.top.expect("top").0.request_id, "long");
        assert_eq!(board.in_flight(), 0);
    }

    #[test]
    fn alone_is_zero_and_no_wait_is_none() {
        let board = Arc::new(Board::default());
        let t0 = Instant::now();
        let a = board.enter(who("a"), 10, t0);
        a.first_token(ms(t0, 50));
        let blame = a.leave(None, Some(10), ms(t0, 100)).expect("blame");
        assert_eq!(blame, Blame::default());
        // Ended before the next one was sent: not a blocker.
        let b = board.enter(who("b"), 10, ms(t0, 200));
        b.first_token(ms(t0, 250));
        assert_eq!(b.leave(None, None, ms(t0, 300)).expect("b").requests, 0);
        // No first token and no engine phases: no known wait.
        let c = board.enter(who("c"), 10, ms(t0, 400));
        assert_eq!(c.leave(None, None, ms(t0, 500)), None);
        // Not streamed: the engine's queue + prefill end the wait.
        let d = board.enter(who("d"), 10, ms(t0, 600));
        let e = board.enter(who("e"), 900, ms(t0, 610));
        let bd = d.leave(Some(ms(t0, 700)), None, ms(t0, 800)).expect("d");
        assert_eq!(bd.requests, 1, "e is in prefill still");
        assert!((bd.blocked_ms - 90.0).abs() < 1e-6);
        drop(e);
        assert_eq!(board.in_flight(), 0);
    }

    #[test]
    fn a_decoding_request_is_not_a_blocker_and_a_dropped_ticket_leaves_no_trace() {
        let board = Arc::new(Board::default());
        let t0 = Instant::now();
        let dec = board.enter(who("decoding"), 5000, t0);
        dec.first_token(ms(t0, 10));
        let retried = board.enter(who("retried"), 7000, ms(t0, 20));
        drop(retried);
        let a = board.enter(who("a"), 10, ms(t0, 100));
        a.first_token(ms(t0, 150));
        let blame = a.leave(None, None, ms(t0, 200)).expect("a");
        assert_eq!(blame.requests, 0);
        drop(dec);
    }

    #[test]
    fn ended_requests_are_bounded() {
        let board = Arc::new(Board::default());
        let t0 = Instant::now();
        for i in 0..(ENDED_CAP as u64 + 100) {
            let t = board.enter(who("x"), 1, ms(t0, i));
            t.first_token(ms(t0, i + 1));
            let _ = t.leave(None, None, ms(t0, i + 2));
        }
        assert_eq!(board.inner.lock().ended.len(), ENDED_CAP);
    }

    #[test]
    fn requests_of_one_step_with_identical_engine_values_are_per_step() {
        let board = Arc::new(Board::default());
        let t0 = Instant::now();
        let key = StepKey::of(Some(82.125), Some(361.5)).expect("key");
        let other = StepKey::of(Some(82.126), Some(361.5)).expect("key");
        assert_eq!(StepKey::of(Some(0.0), Some(1.0)), None, "no zero prefill");
        let a = board.enter(who("a"), 5, ms(t0, 0));
        let b = board.enter(who("b"), 5, ms(t0, 1));
        let c = board.enter(who("c"), 5, ms(t0, 2));
        let d = board.enter(who("d"), 5, ms(t0, 3));
        let (_, ma) = a.leave_step(None, None, ms(t0, 500), Some((key, Some("ta".into()))));
        assert_eq!(ma, StepMates::default(), "alone so far");
        // Different values: its own.
        let (_, md) = d.leave_step(None, None, ms(t0, 501), Some((other, Some("td".into()))));
        assert!(!md.per_step);
        // Same values as a, overlapping it: both per step, a named once.
        let (_, mb) = b.leave_step(None, None, ms(t0, 502), Some((key, Some("tb".into()))));
        assert_eq!(
            mb,
            StepMates {
                per_step: true,
                flag: vec!["ta".to_owned()]
            }
        );
        let (_, mc) = c.leave_step(None, None, ms(t0, 503), Some((key, Some("tc".into()))));
        assert!(mc.per_step);
        assert!(mc.flag.is_empty(), "a and b were named already: {mc:?}");
        // A request sent after they all ended is not of their step, whatever its values.
        let e = board.enter(who("e"), 5, ms(t0, 600));
        let (_, me) = e.leave_step(None, None, ms(t0, 900), Some((key, Some("te".into()))));
        assert!(!me.per_step);
    }
}
