//! Schedule generators: each emits every rank's compute-only order (F, I, W, B and DualPipe's
//! overlapped F&B pairs); [`super::lower`] adds the communication and the bookkeeping.
//!
//! | kind | stages | placement | order on rank r of p, m micro-batches |
//! |------|--------|-----------|----------------------------------------|
//! | `gpipe` | p | stage r on rank r | every F, then every B |
//! | `1f1b` | p | stage r on rank r | p − r − 1 warm-up F, then F B pairs, then the remaining B (PipeDream-flush) |
//! | `interleaved` | p·v | stage s on rank s mod p | Megatron's interleaved 1F1B: virtual micro-batch k runs chunk ⌊k/p⌋ mod v; warm-up 2(p − r − 1) + (v − 1)p |
//! | `zb-h1` | p | stage r on rank r | zero bubble, 1F1B's memory: F limited to p − r micro-batches between F and I, I before F, W filling every wait |
//! | `zb-h2` | p | stage r on rank r | the same with 2(p − r) − 1 micro-batches in flight |
//! | `zb-v` | 2p | V: stages r and 2p − 1 − r on rank r | the zero-bubble paper's ZB-V (§6) |
//! | `dualpipev` | 2p | V | DualPipeV ("cut-in-half" DualPipe), DeepSeek's step order |
//! | `dualpipe` | 2p in two chains | chain 0: stage k on rank k; chain 1 (the mirror, half the micro-batches): layers k on rank p − 1 − k | DualPipe's step order |
//!
//! ZB-H1 / ZB-H2 are built by the zero-bubble paper's greedy rule (Qi et al. 2024, §3) on unit
//! costs: at each moment a rank runs a ready I, else a ready F within its limit of micro-batches
//! between F and I, else a pending W (filling what would be idle time), and the W that never
//! found a gap run at the end.
use std::collections::VecDeque;
use std::str::FromStr;

use super::action::Action;
use super::schedule::{Chain, Schedule};
use crate::ParallelError;

/// The schedules xtrain generates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind {
    GPipe,
    OneFOneB,
    Interleaved,
    ZbH1,
    ZbH2,
    ZbV,
    DualPipeV,
    DualPipe,
}

impl ScheduleKind {
    pub const ALL: [ScheduleKind; 8] = [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbH2,
        ScheduleKind::ZbV,
        ScheduleKind::DualPipeV,
        ScheduleKind::DualPipe,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ScheduleKind::GPipe => "gpipe",
            ScheduleKind::OneFOneB => "1f1b",
            ScheduleKind::Interleaved => "interleaved",
            ScheduleKind::ZbH1 => "zb-h1",
            ScheduleKind::ZbH2 => "zb-h2",
            ScheduleKind::ZbV => "zb-v",
            ScheduleKind::DualPipeV => "dualpipev",
            ScheduleKind::DualPipe => "dualpipe",
        }
    }

    /// The `virtual_stages` a kind runs with when none is given: 2 for interleaved (its
    /// smallest, Megatron's usual choice), 1 for every other kind.
    pub fn default_virtual_stages(self) -> usize {
        if self == ScheduleKind::Interleaved {
            2
        } else {
            1
        }
    }

    /// Stages per pp rank the kind runs (`virtual_stages` for interleaved).
    pub fn stages_per_rank(self, virtual_stages: usize) -> usize {
        match self {
            ScheduleKind::Interleaved => virtual_stages,
            ScheduleKind::ZbV | ScheduleKind::DualPipeV | ScheduleKind::DualPipe => 2,
            _ => 1,
        }
    }
}

impl FromStr for ScheduleKind {
    type Err = ParallelError;
    fn from_str(s: &str) -> Result<Self, ParallelError> {
        ScheduleKind::ALL
            .into_iter()
            .find(|k| k.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                let names: Vec<&str> = ScheduleKind::ALL.iter().map(|k| k.name()).collect();
                ParallelError::Schedule(format!(
                    "unknown schedule `{s}` (known: {}, or csv:FILE)",
                    names.join(", ")
                ))
            })
    }
}

fn bad<T>(msg: String) -> Result<T, ParallelError> {
    Err(ParallelError::Schedule(msg))
}

/// Every rank's compute-only order of `kind` for `pp` ranks and `m` micro-batches per step
/// (`virtual_stages` chunks per rank for interleaved).
pub fn generate(
    kind: ScheduleKind,
    pp: usize,
    m: usize,
    virtual_stages: usize,
) -> Result<Schedule, ParallelError> {
    if pp == 0 || m == 0 {
        return bad(format!(
            "a schedule needs pp ≥ 1 and m ≥ 1 (pp = {pp}, m = {m})"
        ));
    }
    let v = kind.stages_per_rank(virtual_stages);
    if kind == ScheduleKind::Interleaved && virtual_stages < 2 {
        return bad("interleaved 1F1B needs --virtual-stages ≥ 2 (with 1 it is 1f1b)".into());
    }
    if kind != ScheduleKind::Interleaved && virtual_stages > 1 && v != virtual_stages {
        return bad(format!(
            "{} runs {v} stage(s) per rank, not virtual_stages = {virtual_stages}",
            kind.name()
        ));
    }
    let one_chain = |stage_rank: Vec<usize>, actions: Vec<Vec<Action>>| Schedule {
        kind: kind.name().into(),
        chains: vec![Chain {
            stages: 0..stage_rank.len(),
            microbatches: 0..m,
        }],
        stage_rank,
        actions,
    };
    let straight: Vec<usize> = (0..pp).collect();
    let v_shape: Vec<usize> = (0..2 * pp)
        .map(|s| if s < pp { s } else { 2 * pp - 1 - s })
        .collect();
    Ok(match kind {
        ScheduleKind::GPipe => one_chain(straight, (0..pp).map(|r| gpipe(r, m)).collect()),
        ScheduleKind::OneFOneB => {
            one_chain(straight, (0..pp).map(|r| one_f_one_b(pp, r, m)).collect())
        }
        ScheduleKind::Interleaved => {
            if !m.is_multiple_of(pp) {
                return bad(format!(
                    "interleaved 1F1B needs the micro-batches ({m}) to be a multiple of pp ({pp})"
                ));
            }
            let placement = (0..pp * v).map(|s| s % pp).collect();
            one_chain(
                placement,
                (0..pp).map(|r| interleaved(pp, v, r, m)).collect(),
            )
        }
        ScheduleKind::ZbH1 => one_chain(straight, zero_bubble(pp, m, |r| pp - r)),
        ScheduleKind::ZbH2 => one_chain(straight, zero_bubble(pp, m, |r| 2 * (pp - r) - 1)),
        ScheduleKind::ZbV => one_chain(v_shape, (0..pp).map(|r| zb_v(pp, r, m)).collect()),
        ScheduleKind::DualPipeV => {
            if m < 2 * pp {
                return bad(format!(
                    "DualPipeV needs at least 2·pp = {} micro-batches (got {m})",
                    2 * pp
                ));
            }
            let actions = (0..pp)
                .map(|r| {
                    let stage = [r, 2 * pp - 1 - r];
                    dual_steps(pp, r, m, |phase| (stage[phase], 0))
                })
                .collect();
            one_chain(v_shape, actions)
        }
        ScheduleKind::DualPipe => dualpipe(pp, m)?,
    })
}

fn f(stage: usize, mb: usize) -> Action {
    Action::Forward { stage, mb }
}
fn b(stage: usize, mb: usize) -> Action {
    Action::Backward { stage, mb }
}

fn gpipe(r: usize, m: usize) -> Vec<Action> {
    (0..m)
        .map(|mb| f(r, mb))
        .chain((0..m).map(|mb| b(r, mb)))
        .collect()
}

fn one_f_one_b(p: usize, r: usize, m: usize) -> Vec<Action> {
    let warmup = (p - r - 1).min(m);
    let mut out: Vec<Action> = (0..warmup).map(|mb| f(r, mb)).collect();
    let (mut nf, mut nb) = (warmup, 0);
    while nf < m {
        out.push(f(r, nf));
        out.push(b(r, nb));
        nf += 1;
        nb += 1;
    }
    out.extend((nb..m).map(|mb| b(r, mb)));
    out
}

/// Megatron's interleaved 1F1B for rank `r`: virtual micro-batch `k` of `m·v` runs, forward,
/// chunk `⌊k/p⌋ mod v` on micro-batch `⌊k/(p·v)⌋·p + k mod p`; backward the chunks in reverse.
fn interleaved(p: usize, v: usize, r: usize, m: usize) -> Vec<Action> {
    let total = m * v;
    let mb_of = |k: usize| (k / (p * v)) * p + k % p;
    let fwd = |k: usize| f(((k / p) % v) * p + r, mb_of(k));
    let bwd = |k: usize| b((v - 1 - (k / p) % v) * p + r, mb_of(k));
    let warmup = ((p - r - 1) * 2 + (v - 1) * p).min(total);
    let mut out: Vec<Action> = (0..warmup).map(fwd).collect();
    for i in 0..total - warmup {
        out.push(fwd(warmup + i));
        out.push(bwd(i));
    }
    out.extend((total - warmup..total).map(bwd));
    out
}

/// The zero-bubble greedy on unit costs (module doc): `limit(r)` micro-batches may be between
/// their F and their I on rank `r`.
fn zero_bubble(p: usize, m: usize, limit: impl Fn(usize) -> usize) -> Vec<Vec<Action>> {
    let mut free_at = vec![0usize; p];
    let mut f_done: Vec<Vec<Option<usize>>> = vec![vec![None; m]; p];
    let mut i_done: Vec<Vec<Option<usize>>> = vec![vec![None; m]; p];
    let (mut next_f, mut next_i) = (vec![0usize; p], vec![0usize; p]);
    let mut pending_w: Vec<VecDeque<usize>> = vec![VecDeque::new(); p];
    let mut in_flight = vec![0usize; p];
    let mut out: Vec<Vec<Action>> = vec![Vec::new(); p];
    let mut left = 3 * p * m;
    while left > 0 {
        // The rank whose next action can start first (ties: the lower rank).
        let mut best: Option<(usize, usize, Action)> = None;
        for r in 0..p {
            let mut ready = Vec::new();
            let j = next_i[r];
            if j < m {
                let dep = if r + 1 == p {
                    f_done[r][j]
                } else {
                    i_done[r + 1][j]
                };
                if let (Some(d), Some(_)) = (dep, f_done[r][j]) {
                    ready.push((
                        free_at[r].max(d),
                        0,
                        Action::BackwardInput { stage: r, mb: j },
                    ));
                }
            }
            let j = next_f[r];
            if j < m && in_flight[r] < limit(r).max(1) {
                let dep = if r == 0 { Some(0) } else { f_done[r - 1][j] };
                if let Some(d) = dep {
                    ready.push((free_at[r].max(d), 1, f(r, j)));
                }
            }
            let now = ready
                .iter()
                .filter(|c| c.0 <= free_at[r])
                .min_by_key(|c| c.1)
                .copied();
            let pick = match (now, pending_w[r].front()) {
                (Some(c), _) => Some((c.0, c.2)),
                (None, Some(&w)) => Some((free_at[r], Action::BackwardWeight { stage: r, mb: w })),
                (None, None) => ready.iter().min_by_key(|c| (c.0, c.1)).map(|c| (c.0, c.2)),
            };
            if let Some((start, a)) = pick {
                if best.is_none_or(|b| start < b.0) {
                    best = Some((start, r, a));
                }
            }
        }
        let (start, r, a) = best.expect("a greedy pipeline always has a next action");
        let end = start + 1;
        match a {
            Action::Forward { mb, .. } => {
                f_done[r][mb] = Some(end);
                next_f[r] += 1;
                in_flight[r] += 1;
            }
            Action::BackwardInput { mb, .. } => {
                i_done[r][mb] = Some(end);
                next_i[r] += 1;
                in_flight[r] -= 1;
                pending_w[r].push_back(mb);
            }
            _ => {
                pending_w[r].pop_front();
            }
        }
        free_at[r] = end;
        out[r].push(a);
        left -= 1;
    }
    out
}

/// ZB-V (Qi et al. 2024, §6) for rank `r` of `p`: chunk 0 is stage `r`, chunk 1 stage
/// `2p − 1 − r`. The steady phase runs as if there were at least 2p − 1 micro-batches; the
/// actions of micro-batches beyond `m` are then dropped.
fn zb_v(p: usize, r: usize, m: usize) -> Vec<Action> {
    let n = m.max(2 * p - 1);
    let (c0, c1) = (r, 2 * p - 1 - r);
    let (mut f0, mut f1, mut b0, mut b1) = (0, 0, 0, 0);
    let mut out = Vec::new();
    let i = |stage, mb| Action::BackwardInput { stage, mb };
    let w = |stage, mb| Action::BackwardWeight { stage, mb };
    for _ in 0..2 * (p - r) - 1 {
        out.push(f(c0, f0));
        f0 += 1;
    }
    for _ in 0..r {
        out.push(f(c1, f1));
        f1 += 1;
        out.push(f(c0, f0));
        f0 += 1;
    }
    for _ in 0..p - r {
        out.extend([f(c1, f1), i(c1, b1), w(c1, b1)]);
        f1 += 1;
        b1 += 1;
    }
    while f1 < f0 || f0 < n {
        if f0 < n {
            out.push(f(c0, f0));
            f0 += 1;
        }
        out.extend([i(c0, b0), w(c0, b0)]);
        b0 += 1;
        out.extend([f(c1, f1), i(c1, b1), w(c1, b1)]);
        f1 += 1;
        b1 += 1;
    }
    let (mut w0, mut w1) = (b0, b1);
    for _ in 0..r {
        out.extend([i(c0, b0), i(c1, b1)]);
        b0 += 1;
        b1 += 1;
    }
    for _ in 0..p - r {
        out.extend([i(c0, b0), w(c0, w0)]);
        b0 += 1;
        w0 += 1;
    }
    out.extend((w1..b1).map(|mb| w(c1, mb)));
    w1 = b1;
    out.extend((w0..b0).map(|mb| w(c0, mb)));
    debug_assert!(f0 == b0 && f1 == b1 && w1 == b1);
    out.retain(|a| a.microbatch().is_some_and(|mb| mb < m));
    out
}

/// DualPipe's step order (DeepSeek's reference, `dualpipe.py` / `dualpipev.py`) on a
/// pipeline of `n` ranks (DualPipe: each half), for rank `r` of it and `c` micro-batches per
/// direction. `stage(phase)` gives the stage and the first micro-batch id of the phase's
/// chunk. `B` is a fused backward; a zero-bubble backward is an `I` whose `W` is queued and
/// run by the next `W` step.
fn dual_steps(
    n: usize,
    r: usize,
    c: usize,
    stage: impl Fn(usize) -> (usize, usize),
) -> Vec<Action> {
    struct State<S: Fn(usize) -> (usize, usize)> {
        out: Vec<Action>,
        fwd: [usize; 2],
        bwd: [usize; 2],
        weights: VecDeque<(usize, usize)>,
        stage: S,
    }
    impl<S: Fn(usize) -> (usize, usize)> State<S> {
        fn next_f(&mut self, ph: usize) -> (usize, usize) {
            let (s, base) = (self.stage)(ph);
            self.fwd[ph] += 1;
            (s, base + self.fwd[ph] - 1)
        }
        fn next_b(&mut self, ph: usize) -> (usize, usize) {
            let (s, base) = (self.stage)(ph);
            self.bwd[ph] += 1;
            (s, base + self.bwd[ph] - 1)
        }
        fn f(&mut self, ph: usize) {
            let (stage, mb) = self.next_f(ph);
            self.out.push(Action::Forward { stage, mb });
        }
        fn b(&mut self, ph: usize, zero_bubble: bool) {
            let (stage, mb) = self.next_b(ph);
            if zero_bubble {
                self.out.push(Action::BackwardInput { stage, mb });
                self.weights.push_back((stage, mb));
            } else {
                self.out.push(Action::Backward { stage, mb });
            }
        }
        fn w(&mut self) {
            if let Some((stage, mb)) = self.weights.pop_front() {
                self.out.push(Action::BackwardWeight { stage, mb });
            }
        }
        fn fb(&mut self, f_ph: usize, b_ph: usize) {
            let (f_stage, f_mb) = self.next_f(f_ph);
            let (b_stage, b_mb) = self.next_b(b_ph);
            self.out.push(Action::ForwardBackward {
                f_stage,
                f_mb,
                b_stage,
                b_mb,
            });
        }
    }
    let mut st = State {
        out: Vec::new(),
        fwd: [0; 2],
        bwd: [0; 2],
        weights: VecDeque::new(),
        stage,
    };
    // Step 1: nF0.
    for _ in 0..(n - r - 1) * 2 {
        st.f(0);
    }
    // Step 2: nF0F1.
    for _ in 0..r + 1 {
        st.f(0);
        st.f(1);
    }
    // Step 3: nI1W1F1 (zero bubble).
    for _ in 0..n - r - 1 {
        st.b(1, true);
        st.w();
        st.f(1);
    }
    // Step 4 (main): nF0B1F1B0, overlapped pairs; the middle rank's first pair is not.
    for i in 0..c + r + 1 - 2 * n {
        if i == 0 && r == n - 1 {
            st.f(0);
            st.b(1, false);
        } else {
            st.fb(0, 1);
        }
        st.fb(1, 0);
    }
    // Step 5: nB1F1B0.
    for _ in 0..n - r - 1 {
        st.b(1, false);
        st.fb(1, 0);
    }
    // Step 6: nB1B0, the second half with zero bubble.
    let mut zb = false;
    let half = r.div_ceil(2);
    for i in 0..r + 1 {
        if i == half && r % 2 == 1 {
            zb = true;
        }
        st.b(1, zb);
        if i == half && r.is_multiple_of(2) {
            zb = true;
        }
        st.b(0, zb);
    }
    // Step 7: nWB0 (zero bubble).
    for _ in 0..n - r - 1 {
        st.w();
        st.b(0, true);
    }
    // Step 8: nW.
    for _ in 0..r + 1 {
        st.w();
    }
    debug_assert!(st.weights.is_empty() && st.fwd == [c, c] && st.bwd == [c, c]);
    st.out
}

/// DualPipe on `p` ranks (even) and `m` micro-batches (even): chain 0 runs layers k on rank k
/// (stage k) with micro-batches 0..m/2, chain 1 runs layers k on rank p − 1 − k (stage p + k)
/// with m/2..m. Ranks in the first half run chain 0 as their phase 0, the second half chain 1.
fn dualpipe(p: usize, m: usize) -> Result<Schedule, ParallelError> {
    if !p.is_multiple_of(2) || !m.is_multiple_of(2) || m < 2 * p {
        return bad(format!(
            "DualPipe needs an even pp, an even number of micro-batches and at least 2·pp of them (pp = {p}, m = {m})"
        ));
    }
    let half = m / 2;
    let mut stage_rank = vec![0; 2 * p];
    for k in 0..p {
        stage_rank[k] = k;
        stage_rank[p + k] = p - 1 - k;
    }
    let actions = (0..p)
        .map(|r| {
            let second_half = r >= p / 2;
            let chunks = [(r, 0), (p + (p - 1 - r), half)];
            dual_steps(p / 2, r.min(p - 1 - r), half, |phase| {
                chunks[phase ^ usize::from(second_half)]
            })
        })
        .collect();
    Ok(Schedule {
        kind: ScheduleKind::DualPipe.name().into(),
        stage_rank,
        chains: vec![
            Chain {
                stages: 0..p,
                microbatches: 0..half,
            },
            Chain {
                stages: p..2 * p,
                microbatches: half..m,
            },
        ],
        actions,
    })
}
