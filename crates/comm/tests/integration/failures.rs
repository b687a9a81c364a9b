//! Failure paths: every one ends in an error naming the rank, group and operation — never a
//! hang or a panic.

use std::time::{Duration, Instant};

use comm::testing::run_threads_with;
use comm::*;

fn opts(transport: TransportKind, timeout_ms: u64) -> Options {
    Options {
        transport,
        timeout: Duration::from_millis(timeout_ms),
        ..Options::default()
    }
}

const BOTH: [TransportKind; 2] = [TransportKind::Shm, TransportKind::Tcp];

/// Shared memory through the rings, shared memory with single-copy ring steps for every size
/// (and the ring algorithm by default, so small all-reduces take them too), and TCP.
fn paths(timeout_ms: u64) -> [(&'static str, Options); 3] {
    [
        (
            "shm",
            Options {
                shm_single_copy: false,
                ..opts(TransportKind::Shm, timeout_ms)
            },
        ),
        (
            "shm single copy",
            Options {
                single_copy_min_bytes: 0,
                algo: AllReduceAlgo::Ring,
                ..opts(TransportKind::Shm, timeout_ms)
            },
        ),
        ("tcp", opts(TransportKind::Tcp, timeout_ms)),
    ]
}

#[test]
fn a_rank_that_drops_its_communicator_mid_job_is_named_by_every_peer() {
    for (transport, o) in paths(20_000) {
        let t0 = Instant::now();
        let results = run_threads_with(3, o, |c| {
            let mut b = vec![1.0f32; 10_000];
            c.all_reduce_with(&mut b, ReduceOp::Sum, AllReduceAlgo::Ring)
                .unwrap();
            if c.rank() == 2 {
                return None; // drops its communicator while the others go on
            }
            let mut errs = Vec::new();
            for algo in [AllReduceAlgo::Ring, AllReduceAlgo::Tree] {
                errs.push(
                    c.all_reduce_with(&mut b, ReduceOp::Sum, algo)
                        .unwrap_err()
                        .to_string(),
                );
            }
            Some(errs)
        });
        // Far sooner than the 20 s timeout: the closed connection is noticed at once.
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{transport:?}: {:?}",
            t0.elapsed()
        );
        for errs in results.into_iter().flatten() {
            let first = &errs[0];
            assert!(first.contains("rank 2"), "{transport:?}: {first}");
            assert!(
                first.contains("all_reduce") && first.contains("world[0,1,2]"),
                "{first}"
            );
            // Afterwards the group refuses work instead of hanging.
            assert!(errs[1].contains("unusable"), "{}", errs[1]);
        }
    }
}

#[test]
fn a_rank_that_stops_answering_is_named_within_the_timeout() {
    for transport in BOTH {
        let t0 = Instant::now();
        let results = run_threads_with(3, opts(transport, 400), |c| {
            if c.rank() == 1 {
                // Alive (connections open) but never joins the collective.
                std::thread::sleep(Duration::from_millis(1500));
                return None;
            }
            let mut b = vec![1i32; 1000];
            Some(
                c.all_reduce_with(&mut b, ReduceOp::Sum, AllReduceAlgo::Ring)
                    .unwrap_err(),
            )
        });
        for e in results.into_iter().flatten() {
            let s = e.to_string();
            assert!(
                s.contains("rank(s) [1]") || s.contains("[1]"),
                "{transport:?}: {s}"
            );
            assert!(s.contains("all_reduce"), "{s}");
        }
        assert!(t0.elapsed() < Duration::from_secs(5));
    }
}

#[test]
fn a_receive_that_never_gets_its_message_times_out() {
    for transport in BOTH {
        let results = run_threads_with(2, opts(transport, 300), |c| {
            if c.rank() == 1 {
                std::thread::sleep(Duration::from_millis(800));
                return None;
            }
            let t0 = Instant::now();
            let mut b = [0.0f32; 4];
            let e = c.recv(&mut b, 1, 0).unwrap_err();
            Some((e, t0.elapsed()))
        });
        let (e, took) = results.into_iter().flatten().next().unwrap();
        assert!(
            matches!(e, CommError::Timeout { ref ranks, .. } if ranks == &[1]),
            "{e}"
        );
        assert!(e.to_string().contains("send/recv"), "{e}");
        assert!(
            took >= Duration::from_millis(300) && took < Duration::from_secs(3),
            "{took:?}"
        );
    }
}

#[test]
fn mismatched_lengths_types_ops_and_roots_are_reported() {
    type Case = fn(&Communicator) -> Result<()>;
    let cases: [(&str, Case); 5] = [
        ("count", |c| {
            c.all_reduce(&mut vec![1.0f32; 100 + c.rank()], ReduceOp::Sum)
        }),
        ("f32", |c| {
            if c.rank() == 0 {
                c.all_reduce(&mut [1i32; 10], ReduceOp::Sum)
            } else {
                c.all_reduce(&mut [1.0f32; 10], ReduceOp::Sum)
            }
        }),
        ("max", |c| {
            c.all_reduce(
                &mut [1.0f32; 10],
                if c.rank() == 0 {
                    ReduceOp::Max
                } else {
                    ReduceOp::Sum
                },
            )
        }),
        ("broadcast", |c| {
            if c.rank() == 0 {
                c.broadcast(&mut [1.0f32; 10], 0)
            } else {
                c.all_reduce(&mut [1.0f32; 10], ReduceOp::Sum)
            }
        }),
        // Roots that only send cannot notice; the stale message is caught by the next op.
        ("tag", |c| {
            c.broadcast(&mut [1u8; 10], c.rank().min(1))
                .and_then(|_| c.barrier())
        }),
    ];
    for (transport, o) in paths(2_000) {
        for (what, case) in cases {
            let t0 = Instant::now();
            let errs = run_threads_with(3, o.clone(), |c| {
                case(&c)
                    .and_then(|_| c.barrier())
                    .err()
                    .map(|e| e.to_string())
                    .unwrap_or_default()
            });
            // Less than the 2 s timeout (+ grace): detection aborts the group, peers fail at once.
            assert!(
                t0.elapsed() < Duration::from_millis(1900),
                "{what}: took {:?}",
                t0.elapsed()
            );
            assert!(
                errs.iter().filter(|e| !e.is_empty()).count() >= 2,
                "{what}: {errs:#?}"
            );
            assert!(
                errs.iter()
                    .any(|e| e.contains("mismatch") && e.contains(what)),
                "{transport:?} {what}: {errs:#?}"
            );
        }
    }
}

/// An all-gather-v or all-to-all-v into a caller's buffer of the wrong length fails on the
/// rank that passed it, naming the lengths, while the others get their data: nobody waits for
/// a rank that gave up, and the group goes on.
#[test]
fn a_wrong_output_length_fails_on_its_rank_alone() {
    run_threads_with(3, opts(TransportKind::Shm, 5_000), |c| {
        let r = c.rank();
        let short = usize::from(r == 1);
        let mine = vec![r as f32; 4];
        let got = c
            .all_gather_v_into_async(mine.clone(), vec![0.0f32; 12 - short])
            .wait();
        if r == 1 {
            let e = got.unwrap_err().to_string();
            assert!(e.contains("all_gather_v") && e.contains("11"), "{e}");
        } else {
            let (_, all, counts) = got.unwrap();
            assert_eq!(
                all,
                [0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0]
            );
            assert_eq!(counts, vec![4, 4, 4]);
        }
        // Every rank sends 1, 1 and 2 values: rank 2 receives 6, the others 3.
        let want = if r == 2 { 6 } else { 3 };
        let got = c
            .all_to_all_v_into_async(mine, vec![1, 1, 2], vec![0.0f32; want + 2 * short])
            .wait();
        if r == 1 {
            let e = got.unwrap_err().to_string();
            assert!(e.contains("all_to_all_v") && e.contains('5'), "{e}");
        } else {
            let (_, all, counts) = got.unwrap();
            let each = want / 3;
            let expect: Vec<f32> = (0..3).flat_map(|q| vec![q as f32; each]).collect();
            assert_eq!((all, counts), (expect, vec![each; 3]));
        }
        c.barrier().unwrap();
    });
}

#[test]
fn bad_arguments_are_errors() {
    run_threads_with(2, opts(TransportKind::Shm, 2_000), |c| {
        let mut out = vec![0.0f32; 3];
        assert!(c.all_gather(&[1.0f32; 2], &mut out).is_err());
        assert!(c.broadcast(&mut [0u8; 1], 5).is_err());
        assert!(c.send(&[1u8], 9, 0).is_err());
        assert!(c.all_to_all(&[1.0f32; 3], &mut [0.0; 3]).is_err());
        assert!(c.all_to_all_v(&[1.0f32; 3], &[1, 1]).is_err());
        assert!(c.new_group(&[0, 0]).is_err());
        assert!(c.new_group(&[7]).is_err());
        assert!(DeviceMesh::new(&c, &[("dp", 3)]).is_err());
        // The group is still usable after argument errors (nothing was sent).
        c.barrier().unwrap();
    });
}

#[test]
fn forcing_shm_across_hosts_is_an_error() {
    let hosts = ["a".to_string(), "b".to_string()];
    let store: std::sync::Arc<dyn Store> = std::sync::Arc::new(MemStore::new());
    let errs: Vec<String> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let (store, host) = (store.clone(), hosts[r].clone());
                s.spawn(move || {
                    let o = Options {
                        job_id: comm::testing::unique_job_id(),
                        ..opts(TransportKind::Shm, 1000)
                    };
                    let o = Options {
                        job_id: "forced-shm".into(),
                        ..o
                    };
                    Communicator::init(store, r, 2, &host, o)
                        .err()
                        .unwrap()
                        .to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(errs.iter().all(|e| e.contains("forced to shm")), "{errs:?}");
}
