//! The hung-rank locator's verdict: from the operation a rank is stuck in and every rank's
//! [flight record](crate::flight) and heartbeat, one message saying which rank is behind, at
//! which operation of which group, and what the others are waiting in, e.g.
//!
//! ```text
//! rank 1 never entered all_reduce #812 on dp[0,1] (its record shows #811 there); it is stopped
//! (no heartbeat for 3.2 s; record of 16:02:11.500 UTC): last finished send #40 to rank 3 on
//! pp[1,3] at 16:02:11.123 UTC
//! rank 2 waits in all_reduce #812 on dp[2,3] since 16:02:11.130 UTC
//! ```
//!
//! [`diagnose`] is a pure function of its inputs (unit-tested on synthetic records); the
//! [`monitor`](crate::monitor) gathers the inputs through the store.
use std::time::Duration;

use crate::flight::{clock, FlightRecord, OpEntry};
use crate::wire::OpKind;

/// The operation the diagnosing rank is stuck in.
#[derive(Clone, Debug)]
pub struct Stuck {
    /// World rank of the diagnosing rank.
    pub me: usize,
    pub group: String,
    pub kind: OpKind,
    /// Collective number in the group (point-to-point: its number among the group's).
    pub seq: u64,
    /// World ranks this rank still waits for.
    pub waiting_on: Vec<usize>,
}

/// What is known of one world rank.
#[derive(Clone, Debug, Default)]
pub struct PeerState {
    /// Its latest published flight record.
    pub record: Option<FlightRecord>,
    /// How long since its heartbeat last advanced (`None`: heartbeats are off).
    pub silent_for: Option<Duration>,
    /// Whether that is past the heartbeat's limit (the process is stopped or gone).
    pub stopped: bool,
}

/// World ranks listed in a group name such as `dp[0,2]`.
pub fn members(group: &str) -> Vec<usize> {
    group
        .rsplit_once('[')
        .and_then(|(_, rest)| rest.strip_suffix(']'))
        .map(|list| {
            list.split(',')
                .filter_map(|r| r.trim().parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn since(o: &OpEntry) -> String {
    format!("{} since {}", o.describe(), clock(o.started_ms))
}

/// What rank `r` is doing, from its state: stopped, waiting in an operation, or neither.
fn activity(r: usize, p: &PeerState) -> String {
    let last = p
        .record
        .as_ref()
        .and_then(|rec| rec.last_finished())
        .map(|o| {
            format!(
                ": last finished {} at {}",
                o.describe(),
                clock(o.finished_ms.unwrap_or(0))
            )
        })
        .unwrap_or_default();
    if p.stopped {
        // Its record is the one its last heartbeat published: up to one interval old.
        let asof = p.record.as_ref().map_or("no record".to_string(), |rec| {
            format!("record of {}", clock(rec.taken_ms))
        });
        let silent = p.silent_for.map_or(String::new(), |d| {
            format!("no heartbeat for {:.1} s; ", d.as_secs_f64())
        });
        return format!("it is stopped ({silent}{asof}){last}");
    }
    match &p.record {
        None => format!("rank {r} published no flight record (unreachable, or not started)"),
        Some(rec) => match rec.current() {
            Some(op) => format!("it waits in {}", since(op)),
            None => format!("it is alive but in no communication (busy computing?){last}"),
        },
    }
}

/// The one-paragraph diagnosis of `stuck`, given every world rank's state (`peers[r]`).
pub fn diagnose(stuck: &Stuck, peers: &[PeerState]) -> String {
    let none = PeerState::default();
    let state = |r: usize| peers.get(r).unwrap_or(&none);
    let here = format!("{} #{} on {}", stuck.kind.name(), stuck.seq, stuck.group);
    let mut lines = Vec::new();
    for &r in &stuck.waiting_on {
        let p = state(r);
        let doing = activity(r, p);
        let rec = p.record.as_ref();
        let line = if stuck.kind == OpKind::P2p {
            format!("rank {r} has not answered this rank's {here}; {doing}")
        } else {
            let started = rec
                .and_then(|x| x.progress(&stuck.group))
                .map(|g| g.started);
            match started {
                Some(s) if s > stuck.seq => format!(
                    "sequence mismatch: rank {r} is already at collective #{s} on {} ({}) while this rank is at {here}: this rank issued fewer collectives",
                    stuck.group,
                    rec.and_then(|x| x.collective(&stuck.group, s))
                        .map_or("?", |o| o.kind.name())
                ),
                Some(s) if s == stuck.seq => {
                    match rec.and_then(|x| x.collective(&stuck.group, s)) {
                        Some(o) if o.kind != stuck.kind => format!(
                            "sequence mismatch: rank {r} called {} where this rank called {here}",
                            o.describe()
                        ),
                        Some(o) if o.finished_ms.is_none() => {
                            format!("rank {r} is in {here} too, waiting")
                        }
                        _ => format!("rank {r} entered {here} too; {doing}"),
                    }
                }
                _ => {
                    let last = match started {
                        None | Some(0) => " (its record shows none there)".to_string(),
                        Some(s) => format!(" (its record shows #{s} there)"),
                    };
                    let mut line = format!("rank {r} never entered {here}{last}; {doing}");
                    // It waits, alive, in a group this rank belongs to but is not in: the two
                    // issued their operations in different orders.
                    if let Some(op) = rec.and_then(|x| x.current()).filter(|_| !p.stopped) {
                        if op.group != stuck.group && members(&op.group).contains(&stuck.me) {
                            line += &format!(
                                " — sequence mismatch: rank {r} waits in {} on a group with this rank while this rank waits in {here}; one of them skipped or added an operation",
                                op.kind.name()
                            );
                        }
                    }
                    line
                }
            }
        };
        lines.push(line);
    }
    // Everyone else who is waiting, grouped by the operation they wait in.
    let mut waits: Vec<(String, Vec<usize>, u64)> = Vec::new();
    for (r, p) in peers.iter().enumerate() {
        if r == stuck.me || stuck.waiting_on.contains(&r) || p.stopped {
            continue;
        }
        if let Some(op) = p.record.as_ref().and_then(|x| x.current()) {
            let what = op.describe();
            match waits.iter_mut().find(|w| w.0 == what) {
                Some(w) => {
                    w.1.push(r);
                    w.2 = w.2.min(op.started_ms);
                }
                None => waits.push((what, vec![r], op.started_ms)),
            }
        }
    }
    for (what, ranks, started) in waits {
        let who = match ranks.as_slice() {
            [r] => format!("rank {r} waits"),
            rs => format!(
                "ranks {} wait",
                rs.iter()
                    .map(|r| r.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        };
        lines.push(format!("{who} in {what} since {}", clock(started)));
    }
    let stopped: Vec<String> = peers
        .iter()
        .enumerate()
        .filter(|(r, p)| p.stopped && !stuck.waiting_on.contains(r))
        .map(|(r, _)| r.to_string())
        .collect();
    if !stopped.is_empty() {
        lines.push(format!(
            "stopped (no heartbeat): rank(s) {}",
            stopped.join(", ")
        ));
    }
    lines.join("\n  ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flight::{Dir, GroupProgress};

    fn op(group: &str, seq: u64, kind: OpKind, t: u64, done: bool) -> OpEntry {
        OpEntry {
            group: group.into(),
            seq,
            kind,
            bytes: 1024,
            peer: None,
            dir: Dir::None,
            started_ms: t,
            finished_ms: done.then_some(t + 5),
            failed: false,
        }
    }

    fn rec(rank: usize, groups: &[(&str, u64)], ops: Vec<OpEntry>) -> Option<FlightRecord> {
        Some(FlightRecord {
            rank,
            taken_ms: 0,
            groups: groups
                .iter()
                .map(|&(g, n)| GroupProgress {
                    group: g.into(),
                    started: n,
                    finished: n,
                    ..Default::default()
                })
                .collect(),
            ops,
        })
    }

    const T: u64 = ((16 * 60 + 2) * 60 + 11) * 1000;

    #[test]
    fn a_stopped_rank_is_named_with_the_operation_it_never_entered() {
        // dp[0,1] all-reduce #812: rank 0 waits for rank 1, which stopped after a send on pp.
        let mut send = op("pp[1,3]", 40, OpKind::P2p, T, true);
        send.peer = Some(3);
        send.dir = Dir::Send;
        let peers = vec![
            PeerState {
                record: rec(
                    0,
                    &[("dp[0,1]", 812)],
                    vec![op("dp[0,1]", 812, OpKind::AllReduce, T + 9, false)],
                ),
                ..Default::default()
            },
            PeerState {
                record: rec(
                    1,
                    &[("dp[0,1]", 811), ("pp[1,3]", 0)],
                    vec![op("dp[0,1]", 811, OpKind::AllReduce, T - 50, true), send],
                ),
                silent_for: Some(Duration::from_millis(3200)),
                stopped: true,
            },
            PeerState::default(),
            PeerState {
                record: rec(
                    3,
                    &[],
                    vec![op("dp[2,3]", 812, OpKind::AllReduce, T + 8, false)],
                ),
                ..Default::default()
            },
        ];
        let stuck = Stuck {
            me: 0,
            group: "dp[0,1]".into(),
            kind: OpKind::AllReduce,
            seq: 812,
            waiting_on: vec![1],
        };
        let d = diagnose(&stuck, &peers);
        assert!(
            d.starts_with(
                "rank 1 never entered all_reduce #812 on dp[0,1] (its record shows #811 there); it is stopped (no heartbeat for 3.2 s; record of 00:00:00.000 UTC): last finished send #40 to rank 3 on pp[1,3] at 16:02:11.005 UTC"
            ),
            "{d}"
        );
        assert!(
            d.contains("rank 3 waits in all_reduce #812 on dp[2,3] since 16:02:11.008 UTC"),
            "{d}"
        );
        assert!(!d.contains("rank 2"), "no record, not waited on: {d}");
    }

    #[test]
    fn a_skipped_collective_is_a_sequence_mismatch() {
        // Rank 1 skipped dp[1,3]'s all-reduce #3 and waits in the world barrier; rank 3 waits
        // in the all-reduce.
        let world = "world[0,1,2,3]";
        let r1 = rec(
            1,
            &[("dp[1,3]", 2), (world, 1)],
            vec![
                op("dp[1,3]", 2, OpKind::AllReduce, T, true),
                op(world, 1, OpKind::Barrier, T + 10, false),
            ],
        );
        let r3 = rec(
            3,
            &[("dp[1,3]", 3)],
            vec![op("dp[1,3]", 3, OpKind::AllReduce, T + 10, false)],
        );
        let peers = vec![
            PeerState::default(),
            PeerState {
                record: r1,
                silent_for: Some(Duration::from_millis(500)),
                stopped: false,
            },
            PeerState::default(),
            PeerState {
                record: r3,
                ..Default::default()
            },
        ];
        let from3 = Stuck {
            me: 3,
            group: "dp[1,3]".into(),
            kind: OpKind::AllReduce,
            seq: 3,
            waiting_on: vec![1],
        };
        let d = diagnose(&from3, &peers);
        assert!(d.starts_with("rank 1 never entered all_reduce #3 on dp[1,3] (its record shows #2 there); it waits in barrier #1 on world[0,1,2,3] since"), "{d}");
        assert!(
            d.contains("sequence mismatch: rank 1 waits in barrier"),
            "{d}"
        );
        // Seen from rank 1, stuck in the barrier waiting for rank 3.
        let from1 = Stuck {
            me: 1,
            group: world.into(),
            kind: OpKind::Barrier,
            seq: 1,
            waiting_on: vec![3],
        };
        let d = diagnose(&from1, &peers);
        assert!(d.contains("rank 3 never entered barrier #1 on world[0,1,2,3] (its record shows none there); it waits in all_reduce #3 on dp[1,3]"), "{d}");
        assert!(d.contains("sequence mismatch"), "{d}");
        // Different kinds at the same number, and a peer that is ahead.
        let mut ahead = peers.clone();
        ahead[3].record = rec(
            3,
            &[(world, 2)],
            vec![
                op(world, 1, OpKind::AllReduce, T, true),
                op(world, 2, OpKind::Barrier, T, false),
            ],
        );
        let d = diagnose(&from1, &ahead);
        assert!(
            d.contains(
                "sequence mismatch: rank 3 is already at collective #2 on world[0,1,2,3] (barrier)"
            ),
            "{d}"
        );
        ahead[3].record = rec(
            3,
            &[(world, 1)],
            vec![op(world, 1, OpKind::AllReduce, T, false)],
        );
        let d = diagnose(&from1, &ahead);
        assert!(d.contains("sequence mismatch: rank 3 called all_reduce #1 on world[0,1,2,3] where this rank called barrier #1"), "{d}");
    }

    #[test]
    fn names_and_silences() {
        assert_eq!(members("dp[0,2,4]"), [0, 2, 4]);
        assert_eq!(members("world"), Vec::<usize>::new());
        let stuck = Stuck {
            me: 0,
            group: "pp[0,1]".into(),
            kind: OpKind::P2p,
            seq: 4,
            waiting_on: vec![1],
        };
        let d = diagnose(&stuck, &[PeerState::default(), PeerState::default()]);
        assert_eq!(d, "rank 1 has not answered this rank's send/recv #4 on pp[0,1]; rank 1 published no flight record (unreachable, or not started)");
        let busy = PeerState {
            record: rec(1, &[], vec![op("tp[0,1]", 7, OpKind::AllGather, T, true)]),
            ..Default::default()
        };
        let d = diagnose(&stuck, &[PeerState::default(), busy]);
        assert!(d.ends_with("it is alive but in no communication (busy computing?): last finished all_gather #7 on tp[0,1] at 16:02:11.005 UTC"), "{d}");
    }
}
