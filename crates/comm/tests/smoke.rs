use comm::testing::run_threads;
use comm::*;

#[test]
fn smoke_all_reduce() {
    for n in [1, 2, 3, 4] {
        let out = run_threads(n, |c| {
            let mut v: Vec<f32> = (0..1000).map(|i| (i + c.rank()) as f32).collect();
            c.all_reduce_with(&mut v, ReduceOp::Sum, AllReduceAlgo::Ring)
                .unwrap();
            let mut w: Vec<f32> = (0..10).map(|i| (i + c.rank()) as f32).collect();
            c.all_reduce_with(&mut w, ReduceOp::Sum, AllReduceAlgo::Tree)
                .unwrap();
            let mut x: Vec<f32> = (0..77).map(|i| (i + c.rank()) as f32).collect();
            c.all_reduce_with(&mut x, ReduceOp::Sum, AllReduceAlgo::HalvingDoubling)
                .unwrap();
            (v, w, x)
        });
        let s: usize = (0..n).sum();
        for (v, w, x) in out {
            for (i, a) in v.iter().enumerate() {
                assert_eq!(*a, (i * n + s) as f32);
            }
            for (i, a) in w.iter().enumerate() {
                assert_eq!(*a, (i * n + s) as f32);
            }
            for (i, a) in x.iter().enumerate() {
                assert_eq!(*a, (i * n + s) as f32, "n={n}");
            }
        }
    }
}
