//! The hung-rank locator with ranks as threads: a rank that skips one collective of a
//! dp × tp layout makes the waits time out with a diagnosis naming the sequence mismatch,
//! and the flight record of a healthy run lists its operations.
use std::time::Duration;

use comm::testing::run_threads_with;
use comm::{CommError, Options, ReduceOp};

#[test]
fn a_rank_that_skips_a_collective_is_named_with_the_sequence_mismatch() {
    let o = Options {
        timeout: Duration::from_secs(2),
        heartbeat_interval: Duration::from_secs(1),
        ..Options::default()
    };
    // Ranks keep their groups until all have failed (a rank that drops them closes its
    // connections, and its peers would report that instead of their own wait).
    let all_failed = std::sync::Barrier::new(4);
    // World ranks on a 2 × 2 mesh [dp, tp]: tp groups {0,1}, {2,3}; dp groups {0,2}, {1,3}.
    let errors = run_threads_with(4, o, |c| {
        let r = c.rank();
        let tp = c
            .new_named_group("tp", if r < 2 { &[0, 1] } else { &[2, 3] })
            .unwrap();
        let dp = c
            .new_named_group("dp", if r % 2 == 0 { &[0, 2] } else { &[1, 3] })
            .unwrap();
        let mut v = [1.0f32; 8];
        tp.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        let mut run = || {
            for i in 1..=3 {
                if r == 1 && i == 2 {
                    continue; // rank 1 skips dp all-reduce #2 (it then runs #2 as its third)
                }
                dp.all_reduce(&mut v, ReduceOp::Sum)?;
            }
            c.barrier()
        };
        let e = run().err();
        all_failed.wait();
        e
    });
    // Rank 3 waits in dp all-reduce #3, which rank 1 never enters: rank 1 waits in the world
    // barrier instead.
    let e3 = errors[3].as_ref().expect("rank 3 fails");
    assert!(matches!(e3, CommError::Timeout { .. }), "{e3}");
    let s = e3.to_string();
    assert!(
        s.contains("rank 1 never entered all_reduce #3 on dp[1,3] (its record shows #2 there)"),
        "{s}"
    );
    assert!(
        s.contains("it waits in barrier #1 on world[0,1,2,3]"),
        "{s}"
    );
    assert!(s.contains("sequence mismatch"), "{s}");
    // The ranks in the barrier are told that rank 3 never came, and why (directly, or through
    // the abort of the rank that timed out first).
    for r in [0, 1, 2] {
        let s = errors[r].as_ref().expect("every rank fails").to_string();
        assert!(s.contains("rank 3"), "rank {r}: {s}");
        assert!(s.contains("all_reduce #3 on dp[1,3]"), "rank {r}: {s}");
    }
}

#[test]
fn the_flight_record_lists_each_operation_with_its_group_and_number() {
    let records = run_threads_with(2, Options::default(), |c| {
        let mut v = [1.0f32; 4];
        c.all_reduce(&mut v, ReduceOp::Sum).unwrap();
        if c.rank() == 0 {
            c.send(&v, 1, 7).unwrap();
        } else {
            c.recv(&mut v, 0, 7).unwrap();
        }
        c.barrier().unwrap();
        c.flight_record()
    });
    let ops: Vec<String> = records[1].ops.iter().map(|o| o.describe()).collect();
    assert_eq!(
        ops,
        [
            "all_reduce #1 on world[0,1]",
            "recv #1 from rank 0 on world[0,1]",
            "barrier #2 on world[0,1]"
        ]
    );
    let recv = &records[1].ops[1];
    assert_eq!(recv.bytes, 16);
    assert!(records[1]
        .ops
        .iter()
        .all(|o| o.finished_ms >= Some(o.started_ms) && !o.failed));
    assert!(records[1].current().is_none());
}
