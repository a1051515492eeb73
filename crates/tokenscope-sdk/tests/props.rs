//! Property tests: random schedules (arrivals, chunked prefills, mixed batches, preemptions,
//! aborts) driven through the tracker with explicit timestamps, checked against an independent
//! reference model that records, per request, the state it was in at every instant.

use proptest::prelude::*;
use tokenscope_sdk::{
    Clock, FinishReason, RequestHandle, RequestInfo, StepEntry, Tracker, TrackerConfig, Work,
};

/// One scheduler action of the random engine.
#[derive(Debug, Clone)]
enum Op {
    /// A new request with this prompt and output length.
    Arrive { prompt: u32, output: u32 },
    /// Admit up to `n` waiting/preempted requests.
    Admit { n: usize },
    /// One step of `dur` ns with a prefill budget; every running request takes part unless
    /// `skip_mask` leaves it idle.
    Step {
        dur: u64,
        budget: u32,
        skip_mask: u8,
    },
    /// Preempt the running request at this index (mod len).
    Preempt { idx: usize },
    /// Abort the request at this index (mod len of all live).
    Abort { idx: usize },
    /// Time passes.
    Idle { dur: u64 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1u32..2000, 0u32..20).prop_map(|(prompt, output)| Op::Arrive { prompt, output }),
        2 => (1usize..4).prop_map(|n| Op::Admit { n }),
        6 => (1u64..50_000, 1u32..1024, any::<u8>())
            .prop_map(|(dur, budget, skip_mask)| Op::Step { dur, budget, skip_mask }),
        1 => any::<usize>().prop_map(|idx| Op::Preempt { idx }),
        1 => any::<usize>().prop_map(|idx| Op::Abort { idx }),
        1 => (0u64..20_000).prop_map(|dur| Op::Idle { dur }),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RefState {
    Waiting,
    Prefill,
    Decode,
    Preempted,
}

/// The reference: one request of the random engine, with its own phase bookkeeping, kept as a
/// list of `(from, to, phase)` intervals (no shared code with the tracker).
#[derive(Debug)]
struct Sim {
    h: RequestHandle,
    prompt: u32,
    output: u32,
    /// Prompt tokens still to prefill (recompute after preemption: prompt + generated).
    to_prefill: u32,
    generated: u32,
    state: RefState,
    arrival: u64,
    first: Option<u64>,
    last: Option<u64>,
    /// Phase of every elapsed interval.
    intervals: Vec<(u64, u64, usize)>,
    since: u64,
}

impl Sim {
    fn phase(s: RefState) -> usize {
        match s {
            RefState::Waiting | RefState::Preempted => 0,
            RefState::Prefill => 1,
            RefState::Decode => 2,
        }
    }
    fn go(&mut self, t: u64, s: RefState) {
        self.intervals
            .push((self.since, t, Self::phase(self.state)));
        self.since = t;
        self.state = s;
    }
    fn sums(&self) -> [u64; 3] {
        let mut out = [0; 3];
        for (a, b, p) in &self.intervals {
            out[*p] += b - a;
        }
        out
    }
}

/// A step with ≥ 2 participants: its start and the phase credited to each.
type MixedStep = (u64, Vec<(RequestHandle, usize)>);

struct Done {
    sim: Sim,
    reason: FinishReason,
    finish: u64,
}

fn run(
    ops: &[Op],
) -> (
    Vec<Done>,
    Vec<tokenscope_sdk::FinishedRequest>,
    Vec<MixedStep>,
) {
    let mut t = Tracker::new(TrackerConfig::default(), Clock::new());
    let m = t.model("m");
    let mut now = 0u64;
    let mut live: Vec<Sim> = Vec::new();
    let mut done = Vec::new();
    // Per mixed step: which phase the reference credits to each participant.
    let mut steps = Vec::new();
    for op in ops {
        match *op {
            Op::Arrive { prompt, output } => {
                let h = t.arrive_at(now, RequestInfo::new(m, u64::from(prompt)));
                live.push(Sim {
                    h,
                    prompt,
                    output,
                    to_prefill: prompt,
                    generated: 0,
                    state: RefState::Waiting,
                    arrival: now,
                    first: None,
                    last: None,
                    intervals: Vec::new(),
                    since: now,
                });
            }
            Op::Admit { n } => {
                let mut k = 0;
                for s in live.iter_mut() {
                    if k == n {
                        break;
                    }
                    if matches!(s.state, RefState::Waiting | RefState::Preempted) {
                        t.schedule_at(s.h, now);
                        s.go(now, RefState::Prefill);
                        k += 1;
                    }
                }
            }
            Op::Step {
                dur,
                mut budget,
                skip_mask,
            } => {
                let start = now;
                let end = now + dur;
                let mut entries = Vec::new();
                let mut credited = Vec::new();
                for (i, s) in live.iter_mut().enumerate() {
                    if !matches!(s.state, RefState::Prefill | RefState::Decode)
                        || skip_mask & (1 << (i % 8)) != 0
                    {
                        continue;
                    }
                    if s.to_prefill > 0 {
                        let chunk = s.to_prefill.min(budget);
                        if chunk == 0 {
                            continue;
                        }
                        budget -= chunk;
                        s.to_prefill -= chunk;
                        let sampled = s.to_prefill == 0 && s.generated < s.output;
                        entries.push(StepEntry::new(
                            s.h,
                            Work::Prefill {
                                tokens: chunk,
                                sampled,
                            },
                        ));
                        // Reference: before the step, the request's own state; the step is
                        // prefill.
                        s.go(start, RefState::Prefill);
                        credited.push((s.h, 1));
                        if sampled {
                            s.go(end, RefState::Decode);
                            s.generated += 1;
                            s.first.get_or_insert(end);
                            s.last = Some(end);
                        } else {
                            s.go(end, RefState::Prefill);
                        }
                    } else if s.generated < s.output {
                        entries.push(StepEntry::new(s.h, Work::decode()));
                        let during = if s.first.is_some() {
                            RefState::Decode
                        } else {
                            RefState::Prefill
                        };
                        s.go(start, during);
                        credited.push((s.h, Sim::phase(during)));
                        s.go(end, RefState::Decode);
                        s.generated += 1;
                        s.first.get_or_insert(end);
                        s.last = Some(end);
                    }
                }
                t.step_at(start, end, &entries);
                now = end;
                if credited.len() >= 2 {
                    steps.push((start, credited));
                }
                // Finish whoever is complete.
                let mut i = 0;
                while i < live.len() {
                    let s = &live[i];
                    let complete = s.to_prefill == 0
                        && s.generated >= s.output
                        && matches!(s.state, RefState::Prefill | RefState::Decode);
                    if complete {
                        let mut s = live.remove(i);
                        let reason = if s.output.is_multiple_of(2) {
                            FinishReason::Stop
                        } else {
                            FinishReason::Length
                        };
                        t.finish_at(s.h, now, reason);
                        let st = s.state;
                        s.go(now, st);
                        done.push(Done {
                            sim: s,
                            reason,
                            finish: now,
                        });
                    } else {
                        i += 1;
                    }
                }
            }
            Op::Preempt { idx } => {
                let running: Vec<usize> = live
                    .iter()
                    .enumerate()
                    .filter(|(_, s)| matches!(s.state, RefState::Prefill | RefState::Decode))
                    .map(|(i, _)| i)
                    .collect();
                if !running.is_empty() {
                    let s = &mut live[running[idx % running.len()]];
                    t.preempt_at(s.h, now);
                    s.go(now, RefState::Preempted);
                    // Recompute: the prompt and what was generated.
                    s.to_prefill = s.prompt + s.generated;
                }
            }
            Op::Abort { idx } => {
                if !live.is_empty() {
                    let i = idx % live.len();
                    let mut s = live.remove(i);
                    t.abort_at(s.h, now);
                    let st = s.state;
                    s.go(now, st);
                    done.push(Done {
                        sim: s,
                        reason: FinishReason::Abort,
                        finish: now,
                    });
                }
            }
            Op::Idle { dur } => now += dur,
        }
    }
    (done, t.take_finished(), steps)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn phases_match_the_reference(ops in proptest::collection::vec(op(), 1..120)) {
        let (done, finished, _) = run(&ops);
        prop_assert_eq!(done.len(), finished.len());
        for (d, f) in done.iter().zip(&finished) {
            // queue + prefill + decode = finish − arrival, exactly.
            prop_assert_eq!(f.queue_ns + f.prefill_ns + f.decode_ns, f.finish_ns - f.arrival_ns);
            prop_assert_eq!(f.arrival_ns, d.sim.arrival);
            prop_assert_eq!(f.finish_ns, d.finish);
            prop_assert_eq!(f.reason, d.reason);
            // Each phase equals the reference's per-instant attribution.
            let [q, p, dd] = d.sim.sums();
            prop_assert_eq!((f.queue_ns, f.prefill_ns, f.decode_ns), (q, p, dd));
            // TTFT and TPOT by their definitions.
            prop_assert_eq!(f.ttft_ns(), d.sim.first.map(|x| x - d.sim.arrival));
            prop_assert_eq!(f.output_tokens, u64::from(d.sim.generated));
            let tpot = match (d.sim.first, d.sim.last) {
                (Some(a), Some(b)) if d.sim.generated >= 2 => {
                    Some((b - a) as f64 / f64::from(d.sim.generated - 1))
                }
                _ => None,
            };
            prop_assert_eq!(f.tpot_ns(), tpot);
        }
    }

    /// Two requests in one step, one prefilling and one decoding, get different attributions
    /// for that step: the tracker's snapshot deltas across the step show it.
    #[test]
    fn mixed_batch_attributes_per_request(
        prompt in 2u32..3000,
        budget in 1u32..1024,
        dur in 1u64..1_000_000,
        gap in 0u64..1_000_000,
    ) {
        let mut t = Tracker::new(TrackerConfig::default(), Clock::new());
        let m = t.model("m");
        let a = t.arrive_at(0, RequestInfo::new(m, 1));
        t.step_at(0, 10, &[StepEntry::new(a, Work::prefill_last(1))]);
        let b = t.arrive_at(10, RequestInfo::new(m, u64::from(prompt)));
        t.schedule_at(b, 10 + gap);
        let start = 10 + gap;
        let chunk = budget.min(prompt);
        let before = (t.snapshot(a).expect("a"), t.snapshot(b).expect("b"));
        t.step_at(start, start + dur, &[
            StepEntry::new(a, Work::decode()),
            StepEntry::new(b, Work::Prefill { tokens: chunk, sampled: chunk == prompt }),
        ]);
        let after = (t.snapshot(a).expect("a"), t.snapshot(b).expect("b"));
        // a: the gap before the step and the step itself are decode.
        prop_assert_eq!(after.0.decode_ns - before.0.decode_ns, gap + dur);
        prop_assert_eq!(after.0.prefill_ns, before.0.prefill_ns);
        // b: the step is prefill, none of it decode.
        prop_assert_eq!(after.1.prefill_ns - before.1.prefill_ns, dur);
        prop_assert_eq!(after.1.decode_ns, 0);
        prop_assert_eq!(after.1.queue_ns, gap);
    }
}

/// Random schedules really contain mixed steps (the properties above are not vacuous).
#[test]
fn schedules_contain_mixed_steps() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let mut runner = TestRunner::deterministic();
    let mut mixed = 0;
    let mut preempted = 0;
    for _ in 0..200 {
        let ops = proptest::collection::vec(op(), 1..120)
            .new_tree(&mut runner)
            .expect("tree")
            .current();
        let (_, finished, steps) = run(&ops);
        mixed += steps
            .iter()
            .filter(|(_, c)| c.iter().any(|x| x.1 == 1) && c.iter().any(|x| x.1 == 2))
            .count();
        preempted += finished.iter().filter(|f| f.preemptions > 0).count();
    }
    assert!(mixed > 100, "mixed steps {mixed}");
    assert!(preempted > 20, "preempted {preempted}");
}
