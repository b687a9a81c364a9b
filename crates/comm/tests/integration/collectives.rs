//! Every collective against a naive reference, for world sizes 1–8, every dtype and reduce
//! op, every all-reduce algorithm, sync and async, over shared memory, TCP, and a mix.

use std::time::Duration;

use crate::common::*;
use comm::testing::{run_threads, run_threads_on_hosts, run_threads_with};
use comm::*;
use proptest::prelude::*;

const ALGOS: [AllReduceAlgo; 5] = [
    AllReduceAlgo::Ring,
    AllReduceAlgo::Tree,
    AllReduceAlgo::HalvingDoubling,
    AllReduceAlgo::RecursiveDoubling,
    AllReduceAlgo::Auto,
];

fn check_reductions<T: TestElem>(c: &ProcessGroup, seed: u64, lens: &[usize]) {
    let (n, r) = (c.size(), c.rank());
    for &len in lens {
        for op in OPS {
            let want = reference::<T>(n, len, seed, op);
            for algo in ALGOS {
                let mut buf = input::<T>(r, len, seed);
                c.all_reduce_with(&mut buf, op, algo).unwrap();
                assert_eq!(
                    buf,
                    want,
                    "all_reduce {algo:?} {op:?} {} n={n} len={len}",
                    T::DTYPE.name()
                );
            }
            let root = len % n;
            let mut buf = input::<T>(r, len, seed);
            c.reduce(&mut buf, op, root).unwrap();
            if r == root {
                assert_eq!(buf, want, "reduce {op:?} len={len}");
            } else {
                assert_eq!(
                    buf,
                    input::<T>(r, len, seed),
                    "reduce leaves non-roots intact"
                );
            }
            let mut shard = vec![T::zeroed(); shard_range(len, n, r).len()];
            c.reduce_scatter(&input::<T>(r, len, seed), &mut shard, op)
                .unwrap();
            assert_eq!(
                shard,
                want[shard_range(len, n, r)],
                "reduce_scatter {op:?} len={len}"
            );
        }
    }
}

fn check_data_movement<T: TestElem>(c: &ProcessGroup, seed: u64, lens: &[usize]) {
    let (n, r) = (c.size(), c.rank());
    for &len in lens {
        let mine = input::<T>(r, len, seed);
        let everyone: Vec<T> = (0..n).flat_map(|q| input::<T>(q, len, seed)).collect();
        for root in [0, n - 1] {
            let mut b = if r == root {
                mine.clone()
            } else {
                vec![T::zeroed(); len]
            };
            c.broadcast(&mut b, root).unwrap();
            assert_eq!(
                b,
                input::<T>(root, len, seed),
                "broadcast len={len} root={root}"
            );

            let mut out = vec![T::zeroed(); n * len];
            c.gather(&mine, (r == root).then_some(&mut out[..]), root)
                .unwrap();
            if r == root {
                assert_eq!(out, everyone, "gather len={len}");
            }

            let mut part = vec![T::zeroed(); len];
            c.scatter((r == root).then_some(&everyone[..]), &mut part, root)
                .unwrap();
            assert_eq!(part, input::<T>(r, len, seed), "scatter len={len}");
        }
        let mut all = vec![T::zeroed(); n * len];
        c.all_gather(&mine, &mut all).unwrap();
        assert_eq!(all, everyone, "all_gather len={len}");

        // Uneven: rank q contributes len + q elements.
        let (cat, counts) = c.all_gather_v(&input::<T>(r, len + r, seed)).unwrap();
        let want: Vec<T> = (0..n).flat_map(|q| input::<T>(q, len + q, seed)).collect();
        assert_eq!(
            (cat, counts),
            (want.clone(), (0..n).map(|q| len + q).collect::<Vec<_>>())
        );
        // Into a buffer the caller owns (any owned slice: here a boxed one), given back.
        let w = c.all_gather_v_into_async(
            input::<T>(r, len + r, seed).into_boxed_slice(),
            vec![T::zeroed(); want.len()].into_boxed_slice(),
        );
        let (back, cat, counts) = w.wait().unwrap();
        assert_eq!(&back[..], &input::<T>(r, len + r, seed)[..]);
        assert_eq!(
            (&cat[..], counts.len()),
            (&want[..], n),
            "all_gather_v_into"
        );

        // all_to_all: block j of rank q's input is input(q)[j*len..]; rank r gets block r of all.
        let a2a_in = input::<T>(r, n * len, seed);
        let mut a2a_out = vec![T::zeroed(); n * len];
        c.all_to_all(&a2a_in, &mut a2a_out).unwrap();
        let want: Vec<T> = (0..n)
            .flat_map(|q| input::<T>(q, n * len, seed)[r * len..(r + 1) * len].to_vec())
            .collect();
        assert_eq!(a2a_out, want, "all_to_all len={len}");

        // all_to_all_v: rank q sends (q + j + len) % 5 elements to rank j.
        let cnt = |q: usize, j: usize| (q + j + len) % 5;
        let counts: Vec<usize> = (0..n).map(|j| cnt(r, j)).collect();
        let total: usize = counts.iter().sum();
        let (got, rc) = c
            .all_to_all_v(&input::<T>(r, total, seed), &counts)
            .unwrap();
        let mut want = Vec::new();
        for q in 0..n {
            let off: usize = (0..r).map(|j| cnt(q, j)).sum();
            want.extend_from_slice(&input::<T>(q, off + cnt(q, r), seed)[off..]);
        }
        assert_eq!(got, want, "all_to_all_v len={len}");
        assert_eq!(rc, (0..n).map(|q| cnt(q, r)).collect::<Vec<_>>());
        let w = c.all_to_all_v_into_async(
            input::<T>(r, total, seed),
            counts.clone(),
            vec![T::zeroed(); want.len()].into_boxed_slice(),
        );
        let (_, got, rc_into) = w.wait().unwrap();
        assert_eq!((&got[..], &rc_into), (&want[..], &rc), "all_to_all_v_into");
    }
    c.barrier().unwrap();
}

fn check_every_dtype_at(c: &ProcessGroup, seed: u64, lens: &[usize]) {
    check_reductions::<f32>(c, seed, lens);
    check_reductions::<bf16>(c, seed + 1, lens);
    check_reductions::<f16>(c, seed + 2, lens);
    check_reductions::<i32>(c, seed + 3, lens);
    check_reductions::<i64>(c, seed + 4, lens);
    check_reductions::<u8>(c, seed + 5, lens);
    check_data_movement::<f32>(c, seed + 6, lens);
    check_data_movement::<bf16>(c, seed + 7, lens);
    check_data_movement::<u8>(c, seed + 8, lens);
    check_data_movement::<i64>(c, seed + 9, lens);
}

fn check_every_dtype(c: &ProcessGroup, seed: u64) {
    check_every_dtype_at(c, seed, &lengths(c.size()));
}

fn opts(transport: TransportKind) -> Options {
    Options {
        transport,
        timeout: Duration::from_secs(30),
        ..Options::default()
    }
}

/// The two shared-memory data paths: every ring step through the shared rings (single copy
/// forced off), and single copy forced on for every size (threshold 0: even empty and 1-element
/// ring collectives read the peer's buffer directly).
fn shm_paths() -> [(&'static str, Options); 2] {
    let shm = opts(TransportKind::Shm);
    [
        (
            "rings",
            Options {
                shm_single_copy: false,
                ..shm.clone()
            },
        ),
        (
            "single copy",
            Options {
                shm_single_copy: true,
                single_copy_min_bytes: 0,
                ..shm
            },
        ),
    ]
}

/// Asserts that `c` runs the path `o` asks for (single copy wherever this process may use
/// `process_vm_readv`: a sandbox may forbid it, and then the group must fall back).
fn assert_path(c: &ProcessGroup, o: &Options) {
    let want = (o.shm_single_copy && c.size() > 1 && comm::transport::cma::available_here())
        .then_some(o.single_copy_min_bytes);
    assert_eq!(c.single_copy_min_bytes(), want);
}

#[test]
fn every_collective_over_shared_memory_world_sizes_1_to_8() {
    for (path, o) in shm_paths() {
        for n in 1..=8 {
            run_threads_with(n, o.clone(), |c| {
                assert_path(&c, &o);
                check_every_dtype(&c, n as u64);
            });
            eprintln!("{path}: n={n} ok");
        }
    }
}

#[test]
fn single_copy_threshold_boundary_and_large_messages() {
    // Threshold 4 KiB: f32 ring collectives of 1023 elements take the rings, 1024 and more
    // read directly; all-gathers compare the whole output (n × len elements) to it.
    let o = Options {
        single_copy_min_bytes: 4096,
        ..opts(TransportKind::Shm)
    };
    for n in [2, 3, 4] {
        run_threads_with(n, o.clone(), |c| {
            assert_path(&c, &o);
            check_every_dtype_at(&c, 40 + n as u64, &[255, 256, 1023, 1024, 1025, 4099]);
            // Larger than one reduction piece (256 KiB), uneven over n: pieces and tails.
            let len = (3 << 16) + 5;
            let mut b = input::<f32>(c.rank(), len, 3);
            c.all_reduce_with(&mut b, ReduceOp::Avg, AllReduceAlgo::Ring)
                .unwrap();
            assert!(b == reference::<f32>(n, len, 3, ReduceOp::Avg));
            let mut shard = vec![0i64; shard_range(len, n, c.rank()).len()];
            c.reduce_scatter(&input::<i64>(c.rank(), len, 4), &mut shard, ReduceOp::Max)
                .unwrap();
            assert!(
                shard == reference::<i64>(n, len, 4, ReduceOp::Max)[shard_range(len, n, c.rank())]
            );
        });
    }
}

#[test]
fn single_copy_forced_off_by_option() {
    let o = Options {
        shm_single_copy: false,
        single_copy_min_bytes: 0,
        ..opts(TransportKind::Shm)
    };
    run_threads_with(3, o.clone(), |c| {
        assert_eq!(c.single_copy_min_bytes(), None);
        let mut b = input::<f32>(c.rank(), 100_003, 9);
        c.all_reduce_with(&mut b, ReduceOp::Sum, AllReduceAlgo::Ring)
            .unwrap();
        assert!(b == reference::<f32>(3, 100_003, 9, ReduceOp::Sum));
    });
    // Members that disagree still agree on the outcome: one refusal turns it off for all.
    let o = Options {
        single_copy_min_bytes: 0,
        ..opts(TransportKind::Shm)
    };
    let store: std::sync::Arc<dyn Store> = std::sync::Arc::new(MemStore::new());
    let job = comm::testing::unique_job_id();
    std::thread::scope(|s| {
        for r in 0..2 {
            let (store, job) = (store.clone(), job.clone());
            let o = Options {
                job_id: job,
                shm_single_copy: r == 0,
                ..o.clone()
            };
            s.spawn(move || {
                let c = Communicator::init(store, r, 2, "h", o).unwrap();
                assert_eq!(c.single_copy_min_bytes(), None);
                let mut b = input::<i32>(r, 5000, 1);
                c.all_reduce_with(&mut b, ReduceOp::Sum, AllReduceAlgo::Ring)
                    .unwrap();
                assert_eq!(b, reference::<i32>(2, 5000, 1, ReduceOp::Sum));
            });
        }
    });
}

#[test]
fn every_collective_over_tcp() {
    for n in [2, 3, 5] {
        run_threads_with(n, opts(TransportKind::Tcp), |c| {
            check_every_dtype(&c, 100 + n as u64)
        });
    }
}

#[test]
fn mixed_hosts_use_shm_within_and_tcp_across() {
    let hosts: Vec<String> = ["a", "a", "b", "b", "b"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    run_threads_on_hosts(&hosts, opts(TransportKind::Auto), |c| {
        check_every_dtype(&c, 7)
    });
}

#[test]
fn large_all_reduce_streams_through_small_rings() {
    // 1 M f32 = 4 MiB through 16 KiB rings: many wrap-arounds, partial chunks (and, on the
    // single-copy path at its default threshold, ring steps of many 256 KiB pieces).
    let [rings, single] = shm_paths();
    let single = Options {
        single_copy_min_bytes: Options::default().single_copy_min_bytes,
        ..single.1
    };
    for o in [rings.1, single, opts(TransportKind::Tcp)] {
        let transport = o.transport;
        let o = Options {
            shm_ring_bytes: 16 << 10,
            ..o
        };
        run_threads_with(3, o, |c| {
            let len = (1 << 20) + 3;
            for algo in [
                AllReduceAlgo::Ring,
                AllReduceAlgo::HalvingDoubling,
                AllReduceAlgo::Tree,
            ] {
                let mut b = input::<f32>(c.rank(), len, 5);
                c.all_reduce_with(&mut b, ReduceOp::Sum, algo).unwrap();
                assert!(
                    b == reference::<f32>(3, len, 5, ReduceOp::Sum),
                    "{algo:?} {transport:?}"
                );
            }
        });
    }
}

#[test]
fn random_floats_agree_across_algorithms_within_rounding() {
    // Non-integer data: algorithms sum in different orders, so results differ by rounding
    // only: |err| ≤ (n−1)·ε·Σ|x_i| per element (standard summation bound, ε = 2^-24).
    run_threads(5, |c| {
        let len = 4099;
        let x: Vec<f32> = (0..len)
            .map(|i| ((i * 7919 + c.rank() * 104729) % 1000) as f32 / 7.3 - 60.0)
            .collect();
        let exact: Vec<f64> = (0..len)
            .map(|i| {
                (0..5)
                    .map(|r| ((i * 7919 + r * 104729) % 1000) as f64 / 7.3 - 60.0)
                    .sum()
            })
            .collect();
        let abs: Vec<f64> = (0..len)
            .map(|i| {
                (0..5)
                    .map(|r| (((i * 7919 + r * 104729) % 1000) as f64 / 7.3 - 60.0).abs())
                    .sum()
            })
            .collect();
        for algo in ALGOS {
            let mut b = x.clone();
            c.all_reduce_with(&mut b, ReduceOp::Sum, algo).unwrap();
            for i in 0..len {
                let bound = 5.0 * f32::EPSILON as f64 * abs[i] + 1e-6;
                assert!(
                    (b[i] as f64 - exact[i]).abs() <= bound,
                    "{algo:?} i={i}: {} vs {}",
                    b[i],
                    exact[i]
                );
            }
        }
    });
}

#[test]
fn async_collectives_complete_in_submission_order() {
    run_threads(4, |c| {
        let (n, r) = (c.size(), c.rank());
        let len = 1000;
        let w1 = c.all_reduce_async(input::<f32>(r, len, 1), ReduceOp::Sum);
        let w2 = c.all_reduce_with_async(
            input::<bf16>(r, len, 2),
            ReduceOp::Max,
            AllReduceAlgo::HalvingDoubling,
        );
        let w3 = c.all_gather_async(input::<i32>(r, 9, 3));
        let w4 = c.reduce_scatter_async(input::<f32>(r, 77, 4), ReduceOp::Avg);
        let w5 = c.broadcast_async(input::<u8>(r, 33, 5), 2);
        let w6 = c.all_to_all_async(input::<i64>(r, 4 * n, 6));
        let w7 = c.all_to_all_v_async(input::<f32>(r, n, 7), vec![1; n]);
        let w8 = c.all_gather_v_async(input::<f32>(r, r, 8));
        let w9 = c.gather_async(input::<f32>(r, 5, 9), 1);
        let w10 = c.scatter_async(
            (r == 3).then(|| input::<f32>(3, 5 * n, 10)),
            vec![0.0; 5],
            3,
        );
        let w11 = c.reduce_async(input::<i32>(r, 10, 11), ReduceOp::Min, 0);
        let w12 = c.barrier_async();
        // A synchronous call in between waits for the queued work, then runs.
        let mut sync = input::<f32>(r, 10, 12);
        c.all_reduce(&mut sync, ReduceOp::Sum).unwrap();
        assert_eq!(sync, reference::<f32>(n, 10, 12, ReduceOp::Sum));
        assert!(w1.is_completed());
        assert_eq!(
            w1.wait().unwrap(),
            reference::<f32>(n, len, 1, ReduceOp::Sum)
        );
        assert_eq!(
            w2.wait().unwrap(),
            reference::<bf16>(n, len, 2, ReduceOp::Max)
        );
        let all3: Vec<i32> = (0..n).flat_map(|q| input::<i32>(q, 9, 3)).collect();
        assert_eq!(w3.wait().unwrap(), all3);
        assert_eq!(
            w4.wait().unwrap(),
            reference::<f32>(n, 77, 4, ReduceOp::Avg)[shard_range(77, n, r)]
        );
        assert_eq!(w5.wait().unwrap(), input::<u8>(2, 33, 5));
        let want6: Vec<i64> = (0..n)
            .flat_map(|q| input::<i64>(q, 4 * n, 6)[4 * r..4 * r + 4].to_vec())
            .collect();
        assert_eq!(w6.wait().unwrap(), want6);
        let (got7, c7) = w7.wait().unwrap();
        assert_eq!(
            got7,
            (0..n).map(|q| input::<f32>(q, n, 7)[r]).collect::<Vec<_>>()
        );
        assert_eq!(c7, vec![1; n]);
        let (got8, _) = w8.wait().unwrap();
        assert_eq!(
            got8,
            (0..n)
                .flat_map(|q| input::<f32>(q, q, 8))
                .collect::<Vec<_>>()
        );
        let g9 = w9.wait().unwrap();
        assert_eq!(g9.is_some(), r == 1);
        assert_eq!(
            w10.wait().unwrap(),
            input::<f32>(3, 5 * n, 10)[5 * r..5 * r + 5].to_vec()
        );
        let g11 = w11.wait().unwrap();
        if r == 0 {
            assert_eq!(g11, reference::<i32>(n, 10, 11, ReduceOp::Min));
        }
        w12.wait().unwrap();
    });
}

#[test]
fn point_to_point_blocking_async_and_batched_ring_shift() {
    for transport in [TransportKind::Shm, TransportKind::Tcp] {
        run_threads_with(4, opts(transport), |c| {
            let (n, r) = (c.size(), c.rank());
            let (right, left) = ((r + 1) % n, (r + n - 1) % n);
            // Blocking: even ranks send first, odd ranks receive first.
            let mine = input::<f32>(r, 100_003, 1);
            let mut got = vec![0.0f32; 100_003];
            if r % 2 == 0 {
                c.send(&mine, right, 7).unwrap();
                c.recv(&mut got, left, 7).unwrap();
            } else {
                c.recv(&mut got, left, 7).unwrap();
                c.send(&mine, right, 7).unwrap();
            }
            assert_eq!(got, input::<f32>(left, 100_003, 1));
            // Batched ring shift, every rank sending and receiving 1 MiB at once.
            let big = input::<i32>(r, 1 << 18, 2);
            let mut from_left = vec![0i32; 1 << 18];
            c.send_recv(&[(right, &big[..])], &mut [(left, &mut from_left[..])], 1)
                .unwrap();
            assert_eq!(from_left, input::<i32>(left, 1 << 18, 2));
            let w = c.send_recv_async(
                vec![(left, big.clone())],
                vec![(right, vec![0i32; 1 << 18])],
                2,
            );
            assert_eq!(w.wait().unwrap(), vec![input::<i32>(right, 1 << 18, 2)]);
            // Any owned buffers: the sends boxed, the receives vectors.
            let w = c.send_recv_async(
                vec![(left, big.clone().into_boxed_slice())],
                vec![(right, vec![0i32; 1 << 18])],
                4,
            );
            assert_eq!(w.wait().unwrap(), vec![input::<i32>(right, 1 << 18, 2)]);
            // isend/irecv handles (the worker runs them in order: send first, then receive).
            let s = c.isend(input::<u8>(r, 5, 3), right, 3);
            let q = c.irecv(vec![0u8; 5], left, 3);
            assert_eq!(s.wait().unwrap(), input::<u8>(r, 5, 3));
            assert_eq!(q.wait().unwrap(), input::<u8>(left, 5, 3));
            let s = c.isend(input::<u8>(r, 6, 5).into_boxed_slice(), right, 5);
            let q = c.irecv(vec![0u8; 6].into_boxed_slice(), left, 5);
            assert_eq!(&s.wait().unwrap()[..], &input::<u8>(r, 6, 5)[..]);
            assert_eq!(&q.wait().unwrap()[..], &input::<u8>(left, 6, 5)[..]);
        });
    }
}

#[test]
fn mesh_groups_pp_dp_tp() {
    run_threads(8, |c| {
        let mesh = DeviceMesh::new(&c, &[("pp", 2), ("dp", 2), ("tp", 2)]).unwrap();
        let r = c.rank();
        let expect = |dims: &[&str]| mesh.shape().group_ranks(dims, r).unwrap();
        for dims in [
            &["tp"][..],
            &["dp"],
            &["pp"],
            &["dp", "tp"],
            &["pp", "dp"],
            &["pp", "dp", "tp"],
        ] {
            let g = mesh.group(dims).unwrap();
            assert_eq!(g.world_ranks(), expect(dims));
            assert_eq!(g.world_ranks()[g.rank()], r);
            let mut v = vec![r as i64, 1];
            g.all_reduce(&mut v, ReduceOp::Sum).unwrap();
            assert_eq!(
                v,
                vec![expect(dims).iter().sum::<usize>() as i64, g.size() as i64],
                "{dims:?}"
            );
        }
        // tp groups are consecutive ranks; dp pairs differ by 2; pp by 4.
        assert_eq!(mesh.group(&["tp"]).unwrap().world_ranks(), &[r & !1, r | 1]);
        assert_eq!(mesh.group(&["dp"]).unwrap().world_ranks(), &[r & !2, r | 2]);
        assert_eq!(mesh.group(&["pp"]).unwrap().world_ranks(), &[r & !4, r | 4]);
        assert_eq!(mesh.coord("dp").unwrap(), (r >> 1) & 1);
        // Groups are independent: async work on one overlaps with sync work on another.
        let tp = mesh.group(&["tp"]).unwrap();
        let dp = mesh.group(&["dp"]).unwrap();
        let w = tp.all_reduce_async(vec![1.0f32; 5000], ReduceOp::Sum);
        let mut d = vec![1.0f32; 3];
        dp.all_reduce(&mut d, ReduceOp::Sum).unwrap();
        assert_eq!(d, vec![2.0; 3]);
        assert_eq!(w.wait().unwrap(), vec![2.0; 5000]);
    });
}

#[test]
fn counters_match_analytic_volumes() {
    run_threads(4, |c| {
        let (n, len) = (4usize, 4000usize);
        let mut b = vec![1.0f32; len];
        c.all_reduce_with(&mut b, ReduceOp::Sum, AllReduceAlgo::Ring)
            .unwrap();
        c.all_reduce_with(&mut b, ReduceOp::Sum, AllReduceAlgo::Ring)
            .unwrap();
        let mut out = vec![0.0f32; n * len];
        c.all_gather(&b, &mut out).unwrap();
        let s = c.stats();
        // Ring all-reduce: each rank sends 2(n−1)/n of the data per call.
        assert_eq!(s.ops(OpKind::AllReduce), 2);
        assert_eq!(
            s.bytes_sent(OpKind::AllReduce),
            2 * (2 * (n - 1) * len / n * 4) as u64
        );
        // Ring all-gather: (n−1) blocks of len.
        assert_eq!(s.ops(OpKind::AllGather), 1);
        assert_eq!(s.bytes_sent(OpKind::AllGather), ((n - 1) * len * 4) as u64);
        c.reset_stats();
        assert_eq!(c.stats().total_ops(), 0);
    });
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(6))]
    #[test]
    fn all_reduce_and_reduce_scatter_random_lengths(n in 2usize..6, len in 0usize..3000, seed in any::<u64>()) {
        run_threads(n, |c| {
            let r = c.rank();
            for algo in ALGOS {
                let mut b = input::<f32>(r, len, seed);
                c.all_reduce_with(&mut b, ReduceOp::Sum, algo).unwrap();
                assert_eq!(b, reference::<f32>(n, len, seed, ReduceOp::Sum));
            }
            let mut shard = vec![0i32; shard_range(len, n, r).len()];
            c.reduce_scatter(&input::<i32>(r, len, seed), &mut shard, ReduceOp::Max).unwrap();
            assert_eq!(shard, reference::<i32>(n, len, seed, ReduceOp::Max)[shard_range(len, n, r)]);
            let (cat, _) = c.all_gather_v(&input::<u8>(r, (len + r) % 17, seed)).unwrap();
            assert_eq!(cat, (0..n).flat_map(|q| input::<u8>(q, (len + q) % 17, seed)).collect::<Vec<_>>());
        });
    }
}

#[test]
fn handles_are_shareable_across_threads() {
    fn is_send_sync<T: Send + Sync>() {}
    is_send_sync::<Communicator>();
    is_send_sync::<ProcessGroup>();
    is_send_sync::<DeviceMesh>();
    is_send_sync::<Work<Vec<f32>>>();
}
