//! The pipeline-schedule machinery (`parallel::pipeline_parallel`) checked against its
//! definitions, not against its own output:
//!
//! - every generator over a grid of pp, micro-batch counts and virtual stages either builds a
//!   schedule or refuses with a message naming the documented constraint — and refuses
//!   exactly the inputs that break it; every schedule built is valid, runs each (stage,
//!   micro-batch) forward, input gradient and weight gradient exactly once, places stages as
//!   documented, lowers (with and without ZeRO-3 gathers) to matched sends and receives with
//!   one gradient reduction per stage and one optimizer step per rank, simulates with every
//!   bubble in [0, 1) and dependencies respected, and round-trips through its CSV form;
//! - the simulated makespans and bubbles of GPipe, 1F1B, ZB-H1, ZB-H2, ZB-V and interleaved
//!   1F1B equal the closed forms of the papers (cited at each test), and the peak activations
//!   in flight equal each schedule's memory bound;
//! - the rank-by-rank orders of small schedules equal orders written out by hand from the
//!   algorithms (1F1B, GPipe, Megatron's interleaving, the zero-bubble greedy, the lowering);
//! - hand-built wrong schedules are refused with messages naming the problem (backward before
//!   forward, missing micro-batch, out-of-order forwards, a cross-rank deadlock, a stage on
//!   the wrong rank);
//! - cost strings parse (`F=1,B=3,W=1` gives I = 2) and bad ones are errors.
use std::collections::HashMap;

use parallel::pipeline_parallel::schedule::Chain;
use parallel::pipeline_parallel::Action::{self, *};
use parallel::pipeline_parallel::{
    generate, lower, simulate, validate, Costs, LowerOptions, Schedule, ScheduleKind, Simulation,
};
use parallel::ParallelError;

const EPS: f64 = 1e-9;

fn err_text<T: std::fmt::Debug>(r: Result<T, ParallelError>) -> String {
    r.expect_err("expected an error").to_string()
}

/// Unit costs: F = I = W = 1, so a fused B = 2.
fn unit() -> Costs {
    "F=1,I=1,W=1".parse().unwrap()
}

fn sim(kind: ScheduleKind, p: usize, m: usize, v: usize, costs: &Costs) -> Simulation {
    let s = generate(kind, p, m, v).unwrap();
    simulate(&s, costs).unwrap()
}

// ---------------------------------------------------------------------------------------
// 1. The grid.
// ---------------------------------------------------------------------------------------

/// The constraints the generators document, as a predicate computed here: `Some(words)` when
/// `generate(kind, pp, m, v)` must fail with a message containing one of `words`.
/// - interleaved: v ≥ 2 (with 1 it is 1F1B) and m a multiple of pp (Megatron's interleaving
///   walks micro-batches in groups of pp);
/// - dualpipev: m ≥ 2·pp (DeepSeek's dualpipev.py asserts `num_chunks >= num_ranks * 2`);
/// - dualpipe: pp even (the two halves mirror each other), m even (half the micro-batches go
///   each way) and m ≥ 2·pp (dualpipe.py asserts `num_chunks % 2 == 0 and num_chunks >=
///   num_ranks * 2`);
/// - every other kind takes any pp ≥ 1, m ≥ 1.
fn expected_refusal(kind: ScheduleKind, pp: usize, m: usize, v: usize) -> Option<&'static str> {
    match kind {
        ScheduleKind::Interleaved if v < 2 => Some("virtual-stages ≥ 2"),
        ScheduleKind::Interleaved if !m.is_multiple_of(pp) => Some("multiple of pp"),
        ScheduleKind::DualPipeV if m < 2 * pp => Some("at least 2·pp"),
        ScheduleKind::DualPipe if !pp.is_multiple_of(2) || !m.is_multiple_of(2) || m < 2 * pp => {
            Some("even pp, an even number of micro-batches and at least 2·pp")
        }
        _ => None,
    }
}

/// The placement and chains each kind documents (table in `generators.rs`).
fn expected_layout(kind: ScheduleKind, p: usize, m: usize, v: usize) -> (Vec<usize>, Vec<Chain>) {
    let one = |n: usize| {
        vec![Chain {
            stages: 0..n,
            microbatches: 0..m,
        }]
    };
    let v_shape: Vec<usize> = (0..2 * p)
        .map(|s| if s < p { s } else { 2 * p - 1 - s })
        .collect();
    match kind {
        ScheduleKind::GPipe | ScheduleKind::OneFOneB | ScheduleKind::ZbH1 | ScheduleKind::ZbH2 => {
            ((0..p).collect(), one(p))
        }
        ScheduleKind::Interleaved => ((0..p * v).map(|s| s % p).collect(), one(p * v)),
        ScheduleKind::ZbV | ScheduleKind::DualPipeV => (v_shape, one(2 * p)),
        ScheduleKind::DualPipe => {
            // Chain 0: layers k on rank k (stage k), micro-batches 0..m/2; chain 1, the
            // mirror: layers k on rank p − 1 − k (stage p + k), micro-batches m/2..m.
            let placement = (0..p).chain((0..p).map(|k| p - 1 - k)).collect();
            let chains = vec![
                Chain {
                    stages: 0..p,
                    microbatches: 0..m / 2,
                },
                Chain {
                    stages: p..2 * p,
                    microbatches: m / 2..m,
                },
            ];
            (placement, chains)
        }
    }
}

/// Counts of (forward, input gradient, weight gradient) per (stage, micro-batch), over the
/// compute parts of every rank (an F&B pair counts as its F and its B; a B is both gradients).
type Counts = HashMap<(usize, usize), [usize; 3]>;

fn compute_counts(s: &Schedule) -> Counts {
    let mut c: Counts = HashMap::new();
    for list in &s.actions {
        for a in list {
            for part in a.parts() {
                match part {
                    Forward { stage, mb } => c.entry((stage, mb)).or_default()[0] += 1,
                    BackwardInput { stage, mb } => c.entry((stage, mb)).or_default()[1] += 1,
                    BackwardWeight { stage, mb } => c.entry((stage, mb)).or_default()[2] += 1,
                    Backward { stage, mb } => {
                        let e = c.entry((stage, mb)).or_default();
                        e[1] += 1;
                        e[2] += 1;
                    }
                    other => panic!("{}: generators emit compute only, got {other}", s.kind),
                }
            }
        }
    }
    c
}

/// Whether compute part `p` is the forward (`fwd`) or the input gradient (`!fwd`) of
/// (`stage`, `mb`).
fn is_part(p: &Action, fwd: bool, stage: usize, mb: usize) -> bool {
    match *p {
        Forward { stage: s, mb: b } => fwd && s == stage && b == mb,
        BackwardInput { stage: s, mb: b } | Backward { stage: s, mb: b } => {
            !fwd && s == stage && b == mb
        }
        _ => false,
    }
}

/// Position in `list` of the compute action containing the forward / input gradient of
/// (`stage`, `mb`).
fn pos_of(list: &[Action], fwd: bool, stage: usize, mb: usize) -> usize {
    list.iter()
        .position(|a| a.is_compute() && a.parts().iter().any(|p| is_part(p, fwd, stage, mb)))
        .unwrap_or_else(|| panic!("no {} of {stage}/{mb}", if fwd { "F" } else { "I/B" }))
}

/// Whether `a` computes weight gradients of `stage` (a B, a W, or an F&B pair's B) — the
/// definition, written here rather than taken from `Action::computes_weight_grads_of`.
fn weight_of(a: &Action, stage: usize) -> bool {
    a.parts().iter().any(
        |p| matches!(*p, Backward { stage: s, .. } | BackwardWeight { stage: s, .. } if s == stage),
    )
}

fn touches(a: &Action, stage: usize) -> bool {
    a.is_compute() && a.parts().iter().any(|p| p.stage() == Some(stage))
}

/// The lowering's contract (module doc of `lower.rs`) checked on `lower(s, unshard)`.
fn check_lowered(s: &Schedule, unshard: bool) {
    let ctx = format!(
        "{} p={} m={} unshard={unshard}",
        s.kind,
        s.num_ranks(),
        s.num_microbatches()
    );
    let l = lower(s, LowerOptions { unshard }).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    validate(&l).unwrap_or_else(|e| panic!("{ctx}: lowered schedule invalid: {e}"));
    assert_eq!(
        (&l.stage_rank, &l.chains),
        (&s.stage_rank, &s.chains),
        "{ctx}"
    );
    assert_eq!(
        Schedule::from_csv(&l.to_csv()).unwrap(),
        l,
        "{ctx}: lowered CSV round trip"
    );
    // Per link (sending stage, forward?): micro-batches in send order and in receive order.
    let mut links: HashMap<(usize, bool), (Vec<usize>, Vec<usize>)> = HashMap::new();
    for (r, list) in l.actions.iter().enumerate() {
        // The compute order is kept.
        let compute: Vec<Action> = list.iter().copied().filter(|a| a.is_compute()).collect();
        assert_eq!(
            compute, s.actions[r],
            "{ctx}: rank {r}'s compute order changed"
        );
        // Exactly one optimizer step, last.
        assert_eq!(
            list.last(),
            Some(&Optimizer),
            "{ctx}: rank {r} must end with OPTIMIZER"
        );
        assert_eq!(
            list.iter().filter(|a| **a == Optimizer).count(),
            1,
            "{ctx}: rank {r}"
        );
        for st in s.rank_stages(r) {
            let at = |x: Action| -> Vec<usize> {
                list.iter()
                    .enumerate()
                    .filter(|(_, a)| **a == x)
                    .map(|(i, _)| i)
                    .collect()
            };
            let reduce = at(ReduceGrad { stage: st });
            assert_eq!(
                reduce.len(),
                1,
                "{ctx}: rank {r} stage {st} REDUCE_GRAD count"
            );
            let last_w = list.iter().rposition(|a| weight_of(a, st)).unwrap();
            assert!(
                reduce[0] > last_w,
                "{ctx}: {st}REDUCE_GRAD before the last weight gradient"
            );
            let (uns, res) = (at(Unshard { stage: st }), at(Reshard { stage: st }));
            if unshard {
                let first = list.iter().position(|a| touches(a, st)).unwrap();
                let last = list.iter().rposition(|a| touches(a, st)).unwrap();
                assert!(
                    uns.len() == 1 && uns[0] < first,
                    "{ctx}: {st}UNSHARD {uns:?} vs {first}"
                );
                assert!(
                    res.len() == 1 && res[0] > last,
                    "{ctx}: {st}RESHARD {res:?} vs {last}"
                );
            } else {
                assert!(
                    uns.is_empty() && res.is_empty(),
                    "{ctx}: gathers without unshard"
                );
            }
        }
        for (i, a) in list.iter().enumerate() {
            let (key, send, fwd, stage, mb) = match *a {
                SendForward { stage, mb } => ((stage, true), true, true, stage, mb),
                SendBackward { stage, mb } => ((stage, false), true, false, stage, mb),
                RecvForward { stage, mb } => {
                    let from = s.prev_stage(stage).expect("RECV_F at a chain's start");
                    ((from, true), false, true, stage, mb)
                }
                RecvBackward { stage, mb } => {
                    let from = s.next_stage(stage).expect("RECV_B at a chain's end");
                    ((from, false), false, false, stage, mb)
                }
                _ => continue,
            };
            // A send comes after the compute producing it, a receive before the one using it.
            let c = pos_of(list, fwd, stage, mb);
            assert!(
                if send { i > c } else { i < c },
                "{ctx}: rank {r}'s {a} at {i}, compute at {c}"
            );
            let e = links.entry(key).or_default();
            (if send { &mut e.0 } else { &mut e.1 }).push(mb);
        }
    }
    // Every boundary between two stages of a chain on different ranks carries the chain's
    // micro-batches once each way, in increasing order (each stage's forwards and backwards run
    // in micro-batch order), sent on the sender's rank and received on the receiver's; no
    // other link exists.
    let mut expected = 0;
    for c in &s.chains {
        for a in c.stages.start..c.stages.end - 1 {
            if s.stage_rank[a] == s.stage_rank[a + 1] {
                continue;
            }
            let mbs: Vec<usize> = c.microbatches.clone().collect();
            for key in [(a, true), (a + 1, false)] {
                let (sent, recv) = links.get(&key).cloned().unwrap_or_default();
                assert_eq!((&sent, &recv), (&mbs, &mbs), "{ctx}: link {key:?}");
                expected += 1;
            }
        }
    }
    assert_eq!(
        links.len(),
        expected,
        "{ctx}: unexpected links {:?}",
        links.keys()
    );
}

/// What compute part `p` needs, by the dependency rules of the IR (action.rs module doc):
/// F(s) needs F(s − 1) of its chain; I/B(s) needs F(s) and, but at a chain's end, I(s + 1);
/// W(s) needs I(s). Events are (kind 0 = F, 1 = input gradient, 2 = weight gradient, stage,
/// mb).
fn needs_of(s: &Schedule, p: &Action) -> Vec<(u8, usize, usize)> {
    match *p {
        Forward { stage, mb } => s
            .prev_stage(stage)
            .map(|q| (0, q, mb))
            .into_iter()
            .collect(),
        BackwardInput { stage, mb } | Backward { stage, mb } => std::iter::once((0, stage, mb))
            .chain(s.next_stage(stage).map(|n| (1, n, mb)))
            .collect(),
        BackwardWeight { stage, mb } => vec![(1, stage, mb)],
        _ => vec![],
    }
}

fn produced_by(p: &Action) -> Vec<(u8, usize, usize)> {
    match *p {
        Forward { stage, mb } => vec![(0, stage, mb)],
        BackwardInput { stage, mb } => vec![(1, stage, mb)],
        BackwardWeight { stage, mb } => vec![(2, stage, mb)],
        Backward { stage, mb } => vec![(1, stage, mb), (2, stage, mb)],
        _ => vec![],
    }
}

/// The simulator's contract (module doc of `simulate.rs`): each rank runs its compute in
/// order, each action starts as soon as the rank is free and what it needs has ended, lasts
/// its cost; busy, bubble and makespan follow.
fn check_simulation(s: &Schedule, sim: &Simulation, c: &Costs) {
    let ctx = format!("{} p={} m={}", s.kind, s.num_ranks(), s.num_microbatches());
    let cost = |a: &Action| match *a {
        Forward { .. } => c.forward,
        BackwardInput { .. } => c.input,
        BackwardWeight { .. } => c.weight,
        Backward { .. } => c.input + c.weight,
        ForwardBackward { .. } => c.overlapped.unwrap_or(c.forward + c.input + c.weight),
        _ => 0.0,
    };
    let mut end_of: HashMap<(u8, usize, usize), f64> = HashMap::new();
    for slot in &sim.slots {
        for p in slot.action.parts() {
            for e in produced_by(&p) {
                end_of.insert(e, slot.end);
            }
        }
    }
    let p = s.num_ranks();
    let mut makespan: f64 = 0.0;
    for r in 0..p {
        let slots: Vec<_> = sim.slots.iter().filter(|x| x.rank == r).collect();
        let order: Vec<Action> = slots.iter().map(|x| x.action).collect();
        let compute: Vec<Action> = s.actions[r]
            .iter()
            .copied()
            .filter(|a| a.is_compute())
            .collect();
        assert_eq!(order, compute, "{ctx}: rank {r} simulated out of order");
        let mut free = 0.0f64;
        let mut busy = 0.0;
        for x in slots {
            let own: Vec<_> = x.action.parts().iter().flat_map(produced_by).collect();
            let ready = x
                .action
                .parts()
                .iter()
                .flat_map(|q| needs_of(s, q))
                .filter(|e| !own.contains(e))
                .map(|e| end_of[&e])
                .fold(free, f64::max);
            assert!(
                (x.start - ready).abs() < EPS,
                "{ctx}: {} starts {} not {ready}",
                x.action,
                x.start
            );
            assert!(
                (x.end - x.start - cost(&x.action)).abs() < EPS,
                "{ctx}: {} cost",
                x.action
            );
            free = x.end;
            busy += x.end - x.start;
        }
        assert!((sim.busy[r] - busy).abs() < EPS, "{ctx}: rank {r} busy");
        makespan = makespan.max(free);
    }
    assert!((sim.makespan - makespan).abs() < EPS, "{ctx}: makespan");
    for r in 0..p {
        let b = sim.bubble[r];
        assert!((0.0..1.0).contains(&b), "{ctx}: rank {r} bubble {b}");
        assert!(
            (b - (1.0 - sim.busy[r] / sim.makespan)).abs() < EPS,
            "{ctx}: rank {r} bubble"
        );
    }
}

/// Everything a generated schedule must satisfy (the grid's checks).
fn check_generated(s: &Schedule, kind: ScheduleKind, p: usize, m: usize, v: usize) {
    let ctx = format!("{} p={p} m={m} v={v}", kind.name());
    assert_eq!(s.kind, kind.name(), "{ctx}");
    validate(s).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    assert_eq!(s.num_ranks(), p, "{ctx}");
    let (placement, chains) = expected_layout(kind, p, m, v);
    assert_eq!(
        (&s.stage_rank, &s.chains),
        (&placement, &chains),
        "{ctx}: layout"
    );
    // Each (stage, micro-batch of its chain): one F, one I (or B), one W (or B); nothing else.
    let counts = compute_counts(s);
    let mut cells = 0;
    for c in &chains {
        for st in c.stages.clone() {
            for mb in c.microbatches.clone() {
                assert_eq!(
                    counts.get(&(st, mb)),
                    Some(&[1, 1, 1]),
                    "{ctx}: stage {st} mb {mb}"
                );
                cells += 1;
            }
        }
    }
    assert_eq!(
        counts.len(),
        cells,
        "{ctx}: actions on (stage, mb) outside the chains"
    );
    for unshard in [false, true] {
        check_lowered(s, unshard);
    }
    let costs = Costs::default();
    let sm = simulate(s, &costs).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    check_simulation(s, &sm, &costs);
    assert_eq!(
        Schedule::from_csv(&s.to_csv()).unwrap(),
        *s,
        "{ctx}: CSV round trip"
    );
}

#[test]
fn grid_every_kind_generates_or_names_its_constraint() {
    let (mut built, mut refused) = (0, 0);
    for kind in ScheduleKind::ALL {
        let vs = if kind == ScheduleKind::Interleaved {
            1..=3
        } else {
            1..=1
        };
        for v in vs {
            for pp in 1..=8 {
                for m in 1..=16 {
                    let got = generate(kind, pp, m, v);
                    match (expected_refusal(kind, pp, m, v), got) {
                        (None, Ok(s)) => {
                            check_generated(&s, kind, pp, m, v);
                            built += 1;
                        }
                        (Some(words), Err(e)) => {
                            let e = e.to_string();
                            assert!(
                                e.contains(words),
                                "{} pp={pp} m={m} v={v}: `{e}`",
                                kind.name()
                            );
                            refused += 1;
                        }
                        (None, Err(e)) => {
                            panic!("{} pp={pp} m={m} v={v} refused: {e}", kind.name())
                        }
                        (Some(w), Ok(_)) => {
                            panic!("{} pp={pp} m={m} v={v} built (want: {w})", kind.name())
                        }
                    }
                }
            }
        }
    }
    // 10 (kind, v) pairs × 8 × 16 inputs. Refused, counted by hand: interleaved v = 1: 128;
    // v = 2, 3: m not a multiple of pp, 128 − Σ_pp ⌊16/pp⌋ = 128 − (16+8+5+4+3+2+2+2) = 86
    // each; dualpipev:
    // Σ_pp min(2pp − 1, 16) = 1+3+5+7+9+11+13+15 = 64; dualpipe: odd pp 4 × 16 = 64, even pp
    // 2, 4, 6, 8: 16 − (even m ≥ 2pp: 7, 5, 3, 1) = 9 + 11 + 13 + 15 = 48 → 112.
    assert_eq!(refused, 128 + 86 + 86 + 64 + 112);
    assert_eq!(built + refused, 10 * 8 * 16);
}

#[test]
fn degenerate_inputs_are_refused() {
    for kind in ScheduleKind::ALL {
        assert!(err_text(generate(kind, 0, 4, 2)).contains("pp ≥ 1 and m ≥ 1"));
        assert!(err_text(generate(kind, 2, 0, 2)).contains("pp ≥ 1 and m ≥ 1"));
        assert_eq!(kind.name().parse::<ScheduleKind>().unwrap(), kind);
    }
    // A kind with a fixed number of stages per rank refuses another virtual_stages …
    let e = err_text(generate(ScheduleKind::GPipe, 2, 4, 2));
    assert!(e.contains("gpipe runs 1 stage(s) per rank"), "{e}");
    // … and accepts its own (ZB-V runs 2).
    assert!(generate(ScheduleKind::ZbV, 2, 4, 2).is_ok());
    assert!(err_text("pipedream".parse::<ScheduleKind>()).contains("unknown schedule"));
}

// ---------------------------------------------------------------------------------------
// 2. Bubbles and activations against the closed forms.
// ---------------------------------------------------------------------------------------

/// GPipe (Huang et al. 2019) and 1F1B (Narayanan et al. 2019/2021, PipeDream-flush): the
/// makespan is (m + p − 1)·(F + B): the last micro-batch's forward reaches the last stage after
/// (m + p − 1)F, and the first rank's last backward comes (m + p − 1)B later; each rank is
/// busy m(F + B), so its bubble is (p − 1)/(m + p − 1). Peak activations: GPipe holds all m;
/// 1F1B rank r holds its p − r − 1 warm-up forwards plus the one of the first pair, at most m:
/// min(p − r, m).
#[test]
fn gpipe_and_1f1b_bubble_and_activations() {
    assert_eq!(unit(), Costs::default());
    let c: Costs = "F=1,B=2,W=1".parse().unwrap();
    assert_eq!(c, unit(), "B = 2 with W = 1 is I = 1");
    for p in 1..=8 {
        for m in 1..=16 {
            for kind in [ScheduleKind::GPipe, ScheduleKind::OneFOneB] {
                let sm = sim(kind, p, m, 1, &c);
                let ctx = format!("{} p={p} m={m}", kind.name());
                assert_eq!(sm.makespan, ((m + p - 1) * 3) as f64, "{ctx}");
                let want = (p - 1) as f64 / (m + p - 1) as f64;
                for (r, b) in sm.bubble.iter().enumerate() {
                    assert!(
                        (b - want).abs() < EPS,
                        "{ctx}: rank {r} bubble {b} vs {want}"
                    );
                }
                let peak: Vec<usize> = match kind {
                    ScheduleKind::GPipe => vec![m; p],
                    _ => (0..p).map(|r| (p - r).min(m)).collect(),
                };
                assert_eq!(sm.peak_activations, peak, "{ctx}");
            }
        }
    }
}

/// ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", §3 / Fig. 3): its bubble is
/// (p − 1)(T_F + T_B − T_W), T_B the input gradient's time. At unit costs that is p − 1 on
/// each rank busy 3m, so the makespan is 3m + p − 1 and the bubble (p − 1)/(3m + p − 1) — for
/// m ≥ p, where the steady phase exists. This is also the single-step lower bound of any
/// schedule with one stage per rank: the last rank's first forward waits for the forwards of
/// the p − 1 stages before it, then the rank has 3m units of work. Its memory is 1F1B's:
/// rank r holds min(p − r, m) micro-batches' activations.
#[test]
fn zb_h1_bubble_and_activations() {
    for p in 1..=8 {
        for m in 1..=16 {
            let sm = sim(ScheduleKind::ZbH1, p, m, 1, &unit());
            let ctx = format!("zb-h1 p={p} m={m}");
            let peak: Vec<usize> = (0..p).map(|r| (p - r).min(m)).collect();
            assert_eq!(sm.peak_activations, peak, "{ctx}");
            // The lower bound holds for every m.
            assert!(sm.makespan >= (3 * m + p - 1) as f64, "{ctx}");
            if m >= p {
                assert_eq!(sm.makespan, (3 * m + p - 1) as f64, "{ctx}");
                let want = (p - 1) as f64 / (3 * m + p - 1) as f64;
                for b in &sm.bubble {
                    assert!((b - want).abs() < EPS, "{ctx}: bubble {b} vs {want}");
                }
            }
        }
    }
}

/// ZB-H2 and ZB-V against ZB-H1, m ≥ 2p.
///
/// At unit costs ZB-H2 can NOT beat ZB-H1 in a single step: ZB-H1 already meets the lower
/// bound 3m + p − 1 (see `zb_h1_bubble_and_activations`). The paper's ZB-H2 bubble,
/// (p − 1)(T_F + T_B − 2T_W) (Qi et al. 2024, §3), is 0 at T_F = T_B = T_W only because its
/// parallelogram's (p − 1)T_F skew is absorbed across steps (post-validation replaces the
/// optimizer sync); within one step the skew remains. So at unit costs both equal the bound.
/// Where T_B > T_W the two differ: with F = 1, I = 2, W = 1 (`F=1,B=3,W=1`) ZB-H1's makespan
/// is m(F + I + W) + (p − 1)(F + I − W) = 4m + 2(p − 1), ZB-H2's m·4 + (p − 1)(F + I − 2W) =
/// 4m + (p − 1) — the lower bound (p − 1)F + 4m — strictly below.
///
/// ZB-V (§6) runs two chunk stages per rank; with unit costs per chunk action, each rank has
/// 6m units, and the rank holding the V's bottom (stages p − 1 and p) starts after p − 1
/// forwards: bound 6m + p − 1, which ZB-V meets, bubble (p − 1)/(6m + p − 1) < ZB-H1's.
/// Memory: ZB-H2 rank r holds at most 2(p − r) − 1 micro-batches (the generator's limit, at
/// most m); ZB-V peaks at 2p chunk activations on every rank — half a stage each, the same
/// bytes as 1F1B's rank 0 (§6: "the same peak memory as 1F1B").
#[test]
fn zb_h2_and_zb_v_against_zb_h1() {
    let heavy_i: Costs = "F=1,B=3,W=1".parse().unwrap();
    for p in 2..=8 {
        for m in 2 * p..=16 {
            let ctx = format!("p={p} m={m}");
            let h1 = sim(ScheduleKind::ZbH1, p, m, 1, &unit());
            let h2 = sim(ScheduleKind::ZbH2, p, m, 1, &unit());
            let zv = sim(ScheduleKind::ZbV, p, m, 1, &unit());
            assert_eq!(h2.makespan, (3 * m + p - 1) as f64, "{ctx}: zb-h2 unit");
            assert_eq!(h2.makespan, h1.makespan, "{ctx}");
            assert_eq!(zv.makespan, (6 * m + p - 1) as f64, "{ctx}: zb-v unit");
            let zv_want = (p - 1) as f64 / (6 * m + p - 1) as f64;
            for r in 0..p {
                assert!((zv.bubble[r] - zv_want).abs() < EPS, "{ctx}: zb-v rank {r}");
                assert!(zv.bubble[r] < h1.bubble[r], "{ctx}: zb-v not below zb-h1");
            }
            assert_eq!(zv.peak_activations, vec![2 * p; p], "{ctx}: zb-v peak");
            let h1 = sim(ScheduleKind::ZbH1, p, m, 1, &heavy_i);
            let h2 = sim(ScheduleKind::ZbH2, p, m, 1, &heavy_i);
            assert_eq!(
                h1.makespan,
                (4 * m + 2 * (p - 1)) as f64,
                "{ctx}: zb-h1 I=2"
            );
            assert_eq!(h2.makespan, (4 * m + p - 1) as f64, "{ctx}: zb-h2 I=2");
            for r in 0..p {
                assert!(
                    h2.bubble[r] < h1.bubble[r],
                    "{ctx}: zb-h2 not below zb-h1 at I=2"
                );
            }
        }
    }
    for p in 1..=8 {
        for m in 1..=16 {
            let h2 = sim(ScheduleKind::ZbH2, p, m, 1, &unit());
            let bound: Vec<usize> = (0..p).map(|r| (2 * (p - r) - 1).min(m)).collect();
            // Rank 0's entry is min(2p − 1, m) ≤ 2p − 1.
            assert_eq!(h2.peak_activations, bound, "zb-h2 p={p} m={m}");
        }
    }
}

/// DualPipe and DualPipeV against DeepSeek's table (DualPipe README): bubble
/// (PP/2 − 1)(F&B + B − 3W) on the critical rank, peak activations PP + 1, where PP is the
/// pipeline's length in stages — p ranks for DualPipe (each chain p stages long), 2p stages for
/// DualPipeV on p ranks. Checked for costs with F = I (the table's setting: with F ≠ I the
/// step order's own critical path differs, e.g. F = 1, I = 1.5, W = 1, F&B = 3 at p = 4 idles
/// 2.0 units, not the table's 2.5). Idle time = makespan − the rank's work.
#[test]
fn dualpipe_matches_deepseeks_table() {
    for (costs, fb, b, w) in [
        ("F=1,I=1,W=1", 3.0, 2.0, 1.0),
        ("F=1,I=1,W=1,FB=2.5", 2.5, 2.0, 1.0),
        ("F=2,I=2,W=1,FB=4", 4.0, 3.0, 1.0),
    ] {
        let c: Costs = costs.parse().unwrap();
        for p in [2, 4, 6, 8] {
            for (kind, stages) in [
                (ScheduleKind::DualPipe, p),
                (ScheduleKind::DualPipeV, 2 * p),
            ] {
                let m = 4 * p;
                let sm = sim(kind, p, m, 1, &c);
                let ctx = format!("{} p={p} m={m} {costs}", kind.name());
                let idle = (0..p)
                    .map(|r| sm.makespan - sm.busy[r])
                    .fold(0.0f64, f64::max);
                let want = (stages as f64 / 2.0 - 1.0) * (fb + b - 3.0 * w);
                assert!((idle - want).abs() < 1e-9, "{ctx}: idle {idle} vs {want}");
                let peak = sm.peak_activations.iter().copied().max().unwrap();
                assert_eq!(peak, stages + 1, "{ctx}: peak activations");
            }
        }
    }
}

/// Interleaved 1F1B (Narayanan et al. 2021, Megatron-LM, §2.2.2): with v chunks per rank the
/// bubble time shrinks v-fold, to (p − 1)(t_f + t_b)/v with t_f, t_b a whole stage's times;
/// in chunk units (F = 1, B = 2 per chunk action, a stage = v chunks) that is 3(p − 1) on
/// 3vm of work: makespan 3(vm + p − 1), bubble (p − 1)/(vm + p − 1), m a multiple of p.
#[test]
fn interleaved_bubble() {
    for p in 1..=8 {
        for v in 2..=3 {
            for m in (p..=16).step_by(p) {
                let sm = sim(ScheduleKind::Interleaved, p, m, v, &unit());
                let ctx = format!("interleaved p={p} v={v} m={m}");
                assert_eq!(sm.makespan, (3 * (v * m + p - 1)) as f64, "{ctx}");
                let want = (p - 1) as f64 / (v * m + p - 1) as f64;
                for b in &sm.bubble {
                    assert!((b - want).abs() < EPS, "{ctx}: bubble {b} vs {want}");
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// 3. Golden orders, written out by hand.
// ---------------------------------------------------------------------------------------

fn text(s: &Schedule) -> String {
    s.to_string()
}

/// 1F1B, p = 2, m = 4. Rank r: p − r − 1 warm-up forwards, then (F, B) pairs while forwards
/// remain, then the remaining backwards. Rank 0: warm-up 1 (0F0), pairs F1 B0, F2 B1, F3 B2,
/// then B3. Rank 1: no warm-up, pairs F0 B0 … F3 B3.
#[test]
fn golden_1f1b() {
    let s = generate(ScheduleKind::OneFOneB, 2, 4, 1).unwrap();
    assert_eq!(
        text(&s),
        "rank 0: 0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3\n\
         rank 1: 1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3\n"
    );
}

/// GPipe, p = 2, m = 2: every forward, then every backward.
#[test]
fn golden_gpipe() {
    let s = generate(ScheduleKind::GPipe, 2, 2, 1).unwrap();
    assert_eq!(
        text(&s),
        "rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1F1 1B0 1B1\n"
    );
}

/// Interleaved, p = 2, v = 2, m = 4 (Megatron's rule, generator doc). Stages 0..4, stage s on
/// rank s mod 2: rank 0 holds 0 (chunk 0) and 2 (chunk 1), rank 1 holds 1 and 3. Virtual
/// micro-batch k ∈ 0..mv = 0..8 runs chunk ⌊k/p⌋ mod v on micro-batch ⌊k/(pv)⌋·p + k mod p:
///   k:      0   1   2   3   4   5   6   7
///   chunk:  0   0   1   1   0   0   1   1    (backward: chunk v − 1 − that: 1 1 0 0 1 1 0 0)
///   mb:     0   1   0   1   2   3   2   3
/// Warm-up 2(p − r − 1) + (v − 1)p: rank 0 → 4, rank 1 → 2. Then (F k, B j) pairs and the
/// remaining backwards.
/// Rank 0 (chunk c → stage 2c): F0..3 = 0F0 0F1 2F0 2F1; pairs (F4 B0)…(F7 B3) = 0F2 2B0,
/// 0F3 2B1, 2F2 0B0, 2F3 0B1; rest B4..7 = 2B2 2B3 0B2 0B3.
/// Rank 1 (chunk c → stage 2c + 1): F0, F1 = 1F0 1F1; pairs (F2 B0)…(F7 B5) = 3F0 3B0,
/// 3F1 3B1, 1F2 1B0, 1F3 1B1, 3F2 3B2, 3F3 3B3; rest B6, B7 = 1B2 1B3.
#[test]
fn golden_interleaved() {
    let s = generate(ScheduleKind::Interleaved, 2, 4, 2).unwrap();
    assert_eq!(
        text(&s),
        "rank 0: 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3\n\
         rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3\n"
    );
}

/// ZB-H1, p = 2, m = 2, by the greedy of the generator doc on unit costs (limits: rank 0 may
/// hold p − 0 = 2 micro-batches between F and I, rank 1 one; the earliest-starting rank goes
/// first, ties to the lower rank; a ready I beats a ready F, W fills gaps):
///   t=0 r0 F0 · t=1 r0 F1, r1 F0 · t=2 r1 I0 (r0 waits) · t=3 r0 I0, r1 F1 ·
///   t=4 r0 W0 (I1 not ready), r1 I1 · t=5 r0 I1, r1 W0 · t=6 r0 W1, r1 W1 — makespan 7.
#[test]
fn golden_zb_h1() {
    let s = generate(ScheduleKind::ZbH1, 2, 2, 1).unwrap();
    assert_eq!(
        text(&s),
        "rank 0: 0F0 0F1 0I0 0W0 0I1 0W1\nrank 1: 1F0 1I0 1F1 1I1 1W0 1W1\n"
    );
    assert_eq!(simulate(&s, &unit()).unwrap().makespan, 7.0);
}

/// The lowering of 1F1B p = 2, m = 2 with ZeRO-3 gathers, by the rules of `lower.rs`: a
/// RECV one compute action before its consumer (the first action's own at the start), a SEND
/// right after its producer, UNSHARD before a stage's first compute, REDUCE_GRAD and RESHARD
/// after its last, OPTIMIZER at the end. Compute: rank 0 0F0 0F1 0B0 0B1, rank 1 1F0 1B0 1F1
/// 1B1.
#[test]
fn golden_lowered_1f1b() {
    let s = generate(ScheduleKind::OneFOneB, 2, 2, 1).unwrap();
    let l = lower(&s, LowerOptions { unshard: true }).unwrap();
    assert_eq!(
        text(&l),
        "rank 0: 0UNSHARD 0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0B1 0REDUCE_GRAD \
         0RESHARD OPTIMIZER\n\
         rank 1: 1RECV_F0 1UNSHARD 1F0 1RECV_F1 1B0 1SEND_B0 1F1 1B1 1SEND_B1 1REDUCE_GRAD \
         1RESHARD OPTIMIZER\n"
    );
}

// ---------------------------------------------------------------------------------------
// 4. Wrong schedules, named.
// ---------------------------------------------------------------------------------------

/// A one-chain schedule over `stage_rank.len()` stages and `m` micro-batches, from text.
fn hand(stage_rank: Vec<usize>, m: usize, ranks: &[&str]) -> Schedule {
    Schedule {
        kind: "hand".into(),
        chains: vec![Chain {
            stages: 0..stage_rank.len(),
            microbatches: 0..m,
        }],
        stage_rank,
        actions: ranks
            .iter()
            .map(|l| l.split_whitespace().map(|a| a.parse().unwrap()).collect())
            .collect(),
    }
}

#[test]
fn validation_errors_name_the_problem() {
    // The control: a correct hand-built 1F1B passes.
    let ok = hand(vec![0, 1], 2, &["0F0 0F1 0B0 0B1", "1F0 1B0 1F1 1B1"]);
    validate(&ok).unwrap();

    // A backward before its forward on one stage.
    let e = err_text(validate(&hand(vec![0], 1, &["0B0 0F0"])));
    assert!(e.contains("0B0 comes before 0F0"), "{e}");
    // A W before its I.
    let e = err_text(validate(&hand(vec![0], 1, &["0F0 0W0 0I0"])));
    assert!(e.contains("0W0 comes before the input gradient 0I0"), "{e}");

    // Micro-batch 1's forward (and backward) missing.
    let e = err_text(validate(&hand(vec![0], 2, &["0F0 0B0"])));
    assert!(e.contains("rank 0 never runs 0F1"), "{e}");
    // A W missing after its I.
    let e = err_text(validate(&hand(vec![0], 1, &["0F0 0I0"])));
    assert!(e.contains("rank 0 never runs 0W0"), "{e}");

    // Forwards out of micro-batch order.
    let e = err_text(validate(&hand(vec![0], 2, &["0F1 0F0 0B0 0B1"])));
    assert!(
        e.contains("0F0: stage 0's forwards must run in increasing micro-batch order"),
        "{e}"
    );
    // A forward run twice.
    let e = err_text(validate(&hand(vec![0], 1, &["0F0 0F0 0B0"])));
    assert!(e.contains("increasing micro-batch order"), "{e}");

    // A cross-rank deadlock. Rank 0 runs 0B0 right after 0F0: it needs rank 1's input
    // gradient 1I0 before it can go on to 0F1. Rank 1 runs both forwards before its first
    // backward: after 1F0 it needs 0F1 for 1F1, so it never reaches 1B0. Rank 0 waits for
    // rank 1's 1B0, rank 1 for rank 0's 0F1 — a cycle. Each stage on its own is in order.
    let dead = hand(vec![0, 1], 2, &["0F0 0B0 0F1 0B1", "1F0 1F1 1B0 1B1"]);
    let e = err_text(validate(&dead));
    assert!(e.contains("can never run"), "{e}");
    assert!(
        e.contains("rank 0: 0B0 (waits for the input gradient 1I0)"),
        "{e}"
    );
    assert!(e.contains("rank 1: 1F1 (waits for 0F1)"), "{e}");
    // Neither the lowering nor the simulator accepts it.
    assert!(err_text(lower(&dead, LowerOptions::default())).contains("can never run"));
    assert!(err_text(simulate(&dead, &unit())).contains("cannot run to its end"));

    // An action naming a stage that runs on another rank, and one naming no stage at all.
    let wrong = hand(vec![0, 1], 1, &["0F0 1F0 0B0", "1B0"]);
    let e = err_text(validate(&wrong));
    assert!(
        e.contains("rank 0's action 1F0 names stage 1, which runs on rank 1"),
        "{e}"
    );
    let e = err_text(validate(&hand(vec![0, 1], 1, &["0F0 0B0 2F0", "1F0 1B0"])));
    assert!(
        e.contains("names stage 2, which does not exist (2 stages)"),
        "{e}"
    );
    // A micro-batch outside the chain.
    let e = err_text(validate(&hand(vec![0], 1, &["0F0 0B0 0F1"])));
    assert!(
        e.contains("micro-batch 1 does not flow through stage 0"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------
// 5. Costs.
// ---------------------------------------------------------------------------------------

#[test]
fn costs_parse() {
    // B is the fused I + W, so I = B − W = 3 − 1 = 2.
    let c: Costs = "F=1,B=3,W=1".parse().unwrap();
    assert_eq!(
        (c.forward, c.input, c.weight, c.overlapped),
        (1.0, 2.0, 1.0, None)
    );
    // W given after B still counts: I = 3 − 2 = 1.
    let c: Costs = "B=3,W=2".parse().unwrap();
    assert_eq!((c.input, c.weight), (1.0, 2.0));
    let c: Costs = "f=2, i=0.5, fb=2.5".parse().unwrap();
    assert_eq!(
        (c.forward, c.input, c.weight, c.overlapped),
        (2.0, 0.5, 1.0, Some(2.5))
    );
    // B < W cannot be split into I + W.
    assert!(err_text("B=0.5,W=1".parse::<Costs>()).contains("less than W"));
    assert!(err_text("X=1".parse::<Costs>()).contains("unknown cost `X`"));
    assert!(err_text("F=abc".parse::<Costs>()).contains("not a non-negative number"));
    assert!(err_text("F=-1".parse::<Costs>()).contains("not a non-negative number"));
    assert!(err_text("F1".parse::<Costs>()).contains("not KEY=VALUE"));
}

#[test]
fn micro_batches_in_flight_decide_where_the_head_computes_its_gradients_early() {
    use parallel::parallelize::head_grads_in_forward;
    let last = |s: &Schedule| s.num_stages() - 1;
    // GPipe holds every micro-batch at the last stage; 1F1B one at a time.
    let g = generate(ScheduleKind::GPipe, 2, 4, 1).unwrap();
    assert_eq!(g.max_in_flight(last(&g)), 4);
    assert_eq!(g.max_in_flight(0), 4);
    assert!(!head_grads_in_forward(&g, g.stage_rank[last(&g)]));
    let o = generate(ScheduleKind::OneFOneB, 2, 4, 1).unwrap();
    assert_eq!(o.max_in_flight(last(&o)), 1);
    assert_eq!(o.max_in_flight(0), 2);
    assert!(head_grads_in_forward(&o, o.stage_rank[last(&o)]));
    // A rank without a loss stage has nothing to decide.
    assert!(head_grads_in_forward(&g, 0));
    // A weight half deferred past the next forward keeps the micro-batch in flight.
    let z = generate(ScheduleKind::ZbH1, 2, 4, 1).unwrap();
    let at_head = z.max_in_flight(last(&z));
    assert_eq!(
        head_grads_in_forward(&z, z.stage_rank[last(&z)]),
        at_head <= 1
    );
}
