//! Every operation of the MPI backend against the own backend, bit for bit, under `mpirun`:
//!
//! ```text
//! cargo build --release -p comm-mpi --features mpi --example mpi_parity
//! mpirun -np 4 target/release/examples/mpi_parity
//! ```
//! Each rank joins both worlds (MPI's, and the own one through the rendezvous store that
//! `mpirun`'s variables point to), then runs every collective, point-to-point and asynchronous
//! form, for every element type and reduction, on the world and on a sub-group whose members
//! are listed out of order, and checks that both backends give identical bits. Inputs are
//! small integers, so every sum is exact whatever order either library adds in. Exits non-zero
//! naming the first difference; rank 0 prints "mpi parity: N checks agree".
use comm::{bf16, f16, CommBackend, Element, Options, ProcessGroup, ReduceOp};

/// Exactly representable small values from (rank, index, seed).
trait Small: Element {
    fn small(v: i64) -> Self;
}
impl Small for f32 {
    fn small(v: i64) -> Self {
        v as f32
    }
}
impl Small for bf16 {
    fn small(v: i64) -> Self {
        bf16::from_f32(v as f32)
    }
}
impl Small for f16 {
    fn small(v: i64) -> Self {
        f16::from_f32(v as f32)
    }
}
impl Small for i32 {
    fn small(v: i64) -> Self {
        v as i32
    }
}
impl Small for i64 {
    fn small(v: i64) -> Self {
        v
    }
}
impl Small for u8 {
    fn small(v: i64) -> Self {
        v as u8
    }
}

fn input<T: Small>(rank: usize, len: usize, seed: usize) -> Vec<T> {
    // 0..=15: sums over a handful of ranks stay exact in bf16 (8 significant bits).
    (0..len)
        .map(|i| T::small(((rank * 7 + i * 3 + seed * 5) % 16) as i64))
        .collect()
}

/// Runs `f` on both groups and requires equal results.
struct Checker {
    checks: usize,
}

impl Checker {
    fn same<R: PartialEq + std::fmt::Debug>(
        &mut self,
        what: &str,
        own: &ProcessGroup,
        mpi: &ProcessGroup,
        f: impl Fn(&ProcessGroup) -> R,
    ) {
        let (a, b) = (f(own), f(mpi));
        if a != b {
            eprintln!(
                "mpi parity: {what} on {} rank {} differs:\n own {a:?}\n mpi {b:?}",
                own.name(),
                own.rank()
            );
            std::process::exit(1);
        }
        self.checks += 1;
    }
}

fn check_type<T: Small>(c: &mut Checker, own: &ProcessGroup, mpi: &ProcessGroup) {
    let (n, r) = (own.size(), own.rank());
    let ty = format!("{:?}", T::DTYPE);
    for len in [0usize, 1, 5, 1000] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let w = format!("{ty} {op:?} len {len}");
            c.same(&format!("all_reduce {w}"), own, mpi, |g| {
                let mut b = input::<T>(r, len, 1);
                g.all_reduce(&mut b, op).unwrap();
                b
            });
            c.same(&format!("all_reduce_async {w}"), own, mpi, |g| {
                g.all_reduce_async(input::<T>(r, len, 2), op)
                    .wait()
                    .unwrap()
            });
            c.same(&format!("reduce {w}"), own, mpi, |g| {
                let mut b = input::<T>(r, len, 3);
                g.reduce(&mut b, op, n - 1).unwrap();
                b
            });
            c.same(&format!("reduce_scatter {w}"), own, mpi, |g| {
                g.reduce_scatter_async(input::<T>(r, len, 4), op)
                    .wait()
                    .unwrap()
            });
        }
        let w = format!("{ty} len {len}");
        c.same(&format!("broadcast {w}"), own, mpi, |g| {
            let mut b = input::<T>(r, len, 5);
            g.broadcast(&mut b, n / 2).unwrap();
            b
        });
        c.same(&format!("all_gather {w}"), own, mpi, |g| {
            let mut out = vec![T::small(0); n * len];
            g.all_gather(&input::<T>(r, len, 6), &mut out).unwrap();
            out
        });
        c.same(&format!("all_gather_v {w}"), own, mpi, |g| {
            g.all_gather_v(&input::<T>(r, len + r, 7)).unwrap()
        });
        c.same(&format!("all_gather_v_into {w}"), own, mpi, |g| {
            let total = (0..n).map(|q| len + q).sum();
            let out = vec![T::small(0); total];
            let (_, out, counts) = g
                .all_gather_v_into_async(input::<T>(r, len + r, 7), out)
                .wait()
                .unwrap();
            (out, counts)
        });
        c.same(&format!("gather {w}"), own, mpi, |g| {
            g.gather_async(input::<T>(r, len, 8), 0).wait().unwrap()
        });
        c.same(&format!("scatter {w}"), own, mpi, |g| {
            let all = (r == 1 % n).then(|| input::<T>(9, n * len, 9));
            let mut out = vec![T::small(0); len];
            g.scatter(all.as_deref(), &mut out, 1 % n).unwrap();
            out
        });
        c.same(&format!("all_to_all {w}"), own, mpi, |g| {
            g.all_to_all_async(input::<T>(r, n * len, 10))
                .wait()
                .unwrap()
        });
        c.same(&format!("all_to_all_v {w}"), own, mpi, |g| {
            let counts: Vec<usize> = (0..n).map(|p| (len + r + 2 * p) % 7).collect();
            let data = input::<T>(r, counts.iter().sum(), 11);
            g.all_to_all_v(&data, &counts).unwrap()
        });
        c.same(&format!("all_to_all_v_into {w}"), own, mpi, |g| {
            let counts: Vec<usize> = (0..n).map(|p| (len + r + 2 * p) % 7).collect();
            let data = input::<T>(r, counts.iter().sum(), 11);
            let total = (0..n).map(|q| (len + q + 2 * r) % 7).sum();
            let (_, out, got) = g
                .all_to_all_v_into_async(data, counts, vec![T::small(0); total])
                .wait()
                .unwrap();
            (out, got)
        });
        if n > 1 {
            c.same(&format!("ring shift {w}"), own, mpi, |g| {
                let (right, left) = ((r + 1) % n, (r + n - 1) % n);
                let send = input::<T>(r, len, 12);
                let mut got = vec![T::small(0); len];
                g.send_recv(&[(right, &send[..])], &mut [(left, &mut got[..])], 3)
                    .unwrap();
                got
            });
            c.same(&format!("isend/irecv {w}"), own, mpi, |g| {
                let (right, left) = ((r + 1) % n, (r + n - 1) % n);
                // A group's asynchronous work runs in submission order, and a large send
                // completes only once its receive is posted: even ranks send first, odd
                // ranks receive first.
                let send = |g: &ProcessGroup| g.isend(input::<T>(r, len, 13), right, 9);
                let recv = |g: &ProcessGroup| g.irecv(vec![T::small(0); len], left, 9);
                if r % 2 == 0 {
                    let s = send(g);
                    let got = recv(g);
                    s.wait().unwrap();
                    got.wait().unwrap()
                } else {
                    let got = recv(g);
                    let s = send(g);
                    s.wait().unwrap();
                    got.wait().unwrap()
                }
            });
        }
    }
    c.same(&format!("barrier {ty}"), own, mpi, |g| g.barrier().unwrap());
}

fn check_group(c: &mut Checker, own: &ProcessGroup, mpi: &ProcessGroup) {
    check_type::<f32>(c, own, mpi);
    check_type::<bf16>(c, own, mpi);
    check_type::<f16>(c, own, mpi);
    check_type::<i32>(c, own, mpi);
    check_type::<i64>(c, own, mpi);
    check_type::<u8>(c, own, mpi);
}

fn main() {
    comm_mpi::register();
    let options = Options::from_env().expect("options");
    let (mpi, _) = comm::env::init_with(Options {
        backend: CommBackend::Mpi,
        ..options.clone()
    })
    .expect("joining MPI's world");
    let (own, _) = comm::env::init_with(Options {
        backend: CommBackend::Own,
        ..options
    })
    .expect("joining the own world");
    let mut c = Checker { checks: 0 };
    check_group(&mut c, &own, &mpi);
    // A sub-group listed out of order: the last rank and the second, group ranks swapped.
    let n = own.size();
    if n >= 3 {
        let members = [n - 1, 1];
        if members.contains(&own.rank()) {
            let own_g = own.new_named_group("pair", &members).unwrap();
            let mpi_g = mpi.new_named_group("pair", &members).unwrap();
            assert_eq!(own_g.rank(), mpi_g.rank());
            check_group(&mut c, &own_g, &mpi_g);
        }
    }
    own.barrier().unwrap();
    if own.rank() == 0 {
        println!("mpi parity: {} checks agree", c.checks);
    }
    drop((own, mpi));
    comm::env::finalize();
}
