//! NCCL's collectives on device buffers against the host's result of the same inputs, bit for
//! bit, in fp32, bf16 and fp16: a one-rank communicator on GPU 0 runs every operation, and
//! where the machine has two GPUs a two-rank communicator runs them with one thread per GPU
//! (inputs on a grid of quarters, so that every sum and average of two is exact in each type
//! and the host's result is the one NCCL must give). Skipped with one visible line where no
//! GPU is found (a failure where `XTRAIN_REQUIRE` lists `gpu` or `XTRAIN_REQUIRE_GPU=1`, as is
//! a GPU without NCCL). Also the communication stream: collectives queued there behind an
//! event of the compute stream and joined by it.
use half::{bf16, f16};
use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;
use tensor::cuda::{device_count, nccl, CudaError, DevBuf, Gpu, Stream};
use tensor::cuda::{NcclBuf, NcclBufMut, NcclComm, NcclId, ReduceOp};
use tensor::dtype::DType;

const FILE: &str = "the NCCL tests (tensor/tests/gpu_nccl.rs)";

mod cuda_emu;

/// The one-rank tests of this file again on the CPU emulation of a CUDA device and of NCCL
/// (`tests/cuda_emu`: communicators of one rank; the two-rank test needs two devices).
#[test]
fn every_nccl_test_on_the_emulated_device() {
    cuda_emu::rerun_on_emulated_device(
        "the NCCL tests (tensor/tests/gpu_nccl.rs)",
        &["every_nccl_test_on_the_emulated_device"],
    );
}

/// What a skip names: the test where the run requires a GPU, else this file (one line).
fn what(test: &str) -> String {
    if tensor::skip::required("gpu") {
        test.to_string()
    } else {
        FILE.to_string()
    }
}

/// GPU 0 with NCCL, or `None` after the skip line.
fn gpu(test: &str) -> Option<Arc<Gpu>> {
    let g = match Gpu::open(0) {
        Ok(g) => g,
        Err(e) => {
            tensor::skip::skip(&what(test), "gpu", &format!("no GPU: {e}"));
            return None;
        }
    };
    match nccl::nccl_version() {
        Ok(v) => {
            eprintln!(
                "NCCL {}.{}.{} ({})",
                v.0,
                v.1,
                v.2,
                nccl::nccl_library_path().unwrap_or_default()
            );
            Some(g)
        }
        Err(e) => {
            tensor::skip::skip(&what(test), "gpu", &format!("a GPU but no NCCL: {e}"));
            None
        }
    }
}

const TYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];

/// `x` rounded to `dtype` (nearest even), as f32.
fn round(dtype: DType, x: f32) -> f32 {
    match dtype {
        DType::F32 => x,
        DType::BF16 => bf16::from_f32(x).to_f32(),
        DType::F16 => f16::from_f32(x).to_f32(),
    }
}

fn bits16(dtype: DType, v: &[f32]) -> Vec<u16> {
    v.iter()
        .map(|&x| match dtype {
            DType::BF16 => bf16::from_f32(x).to_bits(),
            _ => f16::from_f32(x).to_bits(),
        })
        .collect()
}

/// `n` values in [-1000, 1000) with fractions, rounded to `dtype` (nothing exact by chance).
fn values(dtype: DType, n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            round(dtype, u * 2000.0 - 1000.0)
        })
        .collect()
}

/// `n` multiples of 1/4 in [-8, 8): sums and averages of two are exact in every type.
fn quarters(n: usize, seed: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 37 + seed * 11 + 5) % 64) as f32 / 4.0 - 8.0)
        .collect()
}

/// The host's reduction of `inputs` (one per rank) by `op`, rounded once to `dtype`.
fn reduce_host(dtype: DType, inputs: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
    let n = inputs[0].len();
    (0..n)
        .map(|i| {
            let mut it = inputs.iter().map(|v| v[i]);
            let first = it.next().unwrap();
            let r = it.fold(first, |a, b| match op {
                ReduceOp::Sum | ReduceOp::Avg => a + b,
                ReduceOp::Prod => a * b,
                ReduceOp::Max => a.max(b),
                ReduceOp::Min => a.min(b),
            });
            let r = if op == ReduceOp::Avg {
                r / inputs.len() as f32
            } else {
                r
            };
            round(dtype, r)
        })
        .collect()
}

/// A device buffer of one of the three types (16-bit ones as bit patterns, as the engine
/// stores them).
enum Data {
    F32(DevBuf<f32>),
    Half(DType, DevBuf<u16>),
}

impl Data {
    fn upload(g: &Arc<Gpu>, dtype: DType, v: &[f32]) -> Data {
        match dtype {
            DType::F32 => Data::F32(g.upload(v).unwrap()),
            d => Data::Half(d, g.upload(&bits16(d, v)).unwrap()),
        }
    }

    fn zeros(g: &Arc<Gpu>, dtype: DType, n: usize) -> Data {
        Data::upload(g, dtype, &vec![0.0; n])
    }

    fn len(&self) -> usize {
        match self {
            Data::F32(b) => b.len(),
            Data::Half(_, b) => b.len(),
        }
    }

    /// The range `r` to read (each constructor of `NcclBuf` in turn).
    fn buf(&self, r: Range<usize>) -> NcclBuf<'_> {
        match self {
            Data::F32(b) => b.slice(r).into(),
            Data::Half(DType::BF16, b) => NcclBuf::bf16(b.slice(r)),
            Data::Half(d, b) => NcclBuf::half(*d, b.slice(r)).unwrap(),
        }
    }

    fn all(&self) -> NcclBuf<'_> {
        self.buf(0..self.len())
    }

    /// The range `r` to write.
    fn buf_mut(&mut self, r: Range<usize>) -> NcclBufMut<'_> {
        match self {
            Data::F32(b) => b.slice_mut(r).into(),
            Data::Half(DType::F16, b) => NcclBufMut::f16(b.slice_mut(r)),
            Data::Half(d, b) => NcclBufMut::half(*d, b.slice_mut(r)).unwrap(),
        }
    }

    fn all_mut(&mut self) -> NcclBufMut<'_> {
        let n = self.len();
        self.buf_mut(0..n)
    }

    /// The contents, widened to f32 (waits for the stream).
    fn values(&self) -> Vec<f32> {
        match self {
            Data::F32(b) => b.to_host().unwrap(),
            Data::Half(d, b) => b
                .to_host()
                .unwrap()
                .into_iter()
                .map(|h| match d {
                    DType::BF16 => bf16::from_bits(h).to_f32(),
                    _ => f16::from_bits(h).to_f32(),
                })
                .collect(),
        }
    }
}

/// Records a mismatch of `got` against `want` (bit patterns) in `errs`.
fn expect(errs: &mut Vec<String>, what: &str, got: &[f32], want: &[f32]) {
    if got.len() != want.len() {
        errs.push(format!(
            "{what}: {} elements, {} expected",
            got.len(),
            want.len()
        ));
        return;
    }
    let bad: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .collect();
    if let Some(&i) = bad.first() {
        errs.push(format!(
            "{what}: {} of {} elements differ, first [{i}]: {} vs {} expected",
            bad.len(),
            got.len(),
            got[i],
            want[i]
        ));
    }
}

fn is_shape<T: std::fmt::Debug>(errs: &mut Vec<String>, what: &str, r: Result<T, CudaError>) {
    if !matches!(r, Err(CudaError::Shape(_))) {
        errs.push(format!("{what}: {r:?}, a shape error expected"));
    }
}

#[test]
fn one_rank_runs_every_collective() {
    const T: &str = "one_rank_runs_every_collective";
    let Some(g) = gpu(T) else {
        return;
    };
    // The id crosses as bytes, as through the store.
    let id = NcclId::from_bytes(&NcclId::new().unwrap().to_bytes()).unwrap();
    let comm = NcclComm::init(&g, &id, 1, 0).unwrap();
    assert_eq!((comm.rank(), comm.size()), (0, 1));
    let mut errs = Vec::new();
    let n = 1537;
    for (k, dtype) in TYPES.into_iter().enumerate() {
        let x = values(dtype, n, 1 + k as u64);
        let xs = Data::upload(&g, dtype, &x);
        let one = std::slice::from_ref(&x);
        let t = format!("{dtype:?}");
        for op in [
            ReduceOp::Sum,
            ReduceOp::Prod,
            ReduceOp::Max,
            ReduceOp::Min,
            ReduceOp::Avg,
        ] {
            let mut out = Data::zeros(&g, dtype, n);
            comm.all_reduce(xs.all(), out.all_mut(), op).unwrap();
            let want = reduce_host(dtype, one, op);
            expect(
                &mut errs,
                &format!("{t} all_reduce {op:?}"),
                &out.values(),
                &want,
            );
        }
        let mut y = Data::upload(&g, dtype, &x);
        comm.all_reduce_in_place(y.all_mut(), ReduceOp::Sum)
            .unwrap();
        let sum = reduce_host(dtype, one, ReduceOp::Sum);
        expect(
            &mut errs,
            &format!("{t} all_reduce in place"),
            &y.values(),
            &sum,
        );

        let mut out = Data::zeros(&g, dtype, n);
        comm.reduce(xs.all(), out.all_mut(), ReduceOp::Max, 0)
            .unwrap();
        let max = reduce_host(dtype, one, ReduceOp::Max);
        expect(&mut errs, &format!("{t} reduce max"), &out.values(), &max);

        let mut b = Data::upload(&g, dtype, &x);
        comm.broadcast(b.all_mut(), 0).unwrap();
        expect(&mut errs, &format!("{t} broadcast"), &b.values(), &x);

        let mut out = Data::zeros(&g, dtype, n);
        comm.all_gather(xs.all(), out.all_mut()).unwrap();
        expect(&mut errs, &format!("{t} all_gather"), &out.values(), &x);

        let mut out = Data::zeros(&g, dtype, n);
        comm.reduce_scatter(xs.all(), out.all_mut(), ReduceOp::Sum)
            .unwrap();
        expect(
            &mut errs,
            &format!("{t} reduce_scatter"),
            &out.values(),
            &sum,
        );

        // To itself, inside a group, from a sub-range into a sub-range (the rest stays zero).
        let mut out = Data::zeros(&g, dtype, n);
        comm.group(|| {
            comm.send(xs.buf(100..700), 0)?;
            comm.recv(out.buf_mut(300..900), 0)
        })
        .unwrap();
        let mut want = vec![0.0; n];
        want[300..900].copy_from_slice(&x[100..700]);
        expect(
            &mut errs,
            &format!("{t} send/recv to self"),
            &out.values(),
            &want,
        );

        let mut out = Data::zeros(&g, dtype, n);
        comm.all_to_all_v(xs.buf(5..1005), &[1000], out.buf_mut(500..1500), &[1000])
            .unwrap();
        let mut want = vec![0.0; n];
        want[500..1500].copy_from_slice(&x[5..1005]);
        expect(
            &mut errs,
            &format!("{t} all_to_all_v"),
            &out.values(),
            &want,
        );
    }

    // 16-bit types as half's own types.
    let x = values(DType::BF16, n, 9);
    let xb: DevBuf<bf16> = g.upload(&tensor::dtype::to_bf16_vec(&x)).unwrap();
    let mut ob = g.alloc::<bf16>(n).unwrap();
    comm.all_reduce(&xb, &mut ob, ReduceOp::Sum).unwrap();
    let got: Vec<f32> = ob.to_host().unwrap().iter().map(|h| h.to_f32()).collect();
    expect(&mut errs, "half::bf16 all_reduce", &got, &x);
    let x = values(DType::F16, n, 10);
    let xh: DevBuf<f16> = g
        .upload(
            &bits16(DType::F16, &x)
                .iter()
                .map(|&b| f16::from_bits(b))
                .collect::<Vec<_>>(),
        )
        .unwrap();
    let mut oh = g.zeros::<f16>(n).unwrap();
    comm.all_gather(&xh, &mut oh).unwrap();
    let got: Vec<f32> = oh.to_host().unwrap().iter().map(|h| h.to_f32()).collect();
    expect(&mut errs, "half::f16 all_gather", &got, &x);

    // Wrong shapes, roots, peers and types are refused before NCCL is called.
    let a = Data::upload(&g, DType::F32, &values(DType::F32, 8, 3));
    let mut r9 = Data::zeros(&g, DType::F32, 9);
    let mut h8 = Data::zeros(&g, DType::BF16, 8);
    is_shape(
        &mut errs,
        "all_reduce 8 -> 9",
        comm.all_reduce(a.all(), r9.all_mut(), ReduceOp::Sum),
    );
    is_shape(
        &mut errs,
        "all_gather 8 -> 9",
        comm.all_gather(a.all(), r9.all_mut()),
    );
    is_shape(
        &mut errs,
        "reduce_scatter 8 -> 9",
        comm.reduce_scatter(a.all(), r9.all_mut(), ReduceOp::Sum),
    );
    is_shape(
        &mut errs,
        "f32 -> bf16",
        comm.all_reduce(a.all(), h8.all_mut(), ReduceOp::Sum),
    );
    is_shape(
        &mut errs,
        "reduce to root 1",
        comm.reduce(a.all(), r9.buf_mut(0..8), ReduceOp::Sum, 1),
    );
    is_shape(
        &mut errs,
        "broadcast from root 1",
        comm.broadcast(r9.all_mut(), 1),
    );
    is_shape(
        &mut errs,
        "send to peer 1",
        comm.group(|| comm.send(a.all(), 1)),
    );
    is_shape(
        &mut errs,
        "send to self outside a group",
        comm.send(a.all(), 0),
    );
    is_shape(
        &mut errs,
        "recv from self outside a group",
        comm.recv(r9.all_mut(), 0),
    );
    is_shape(
        &mut errs,
        "all_to_all_v counts 7",
        comm.all_to_all_v(a.all(), &[7], r9.buf_mut(0..8), &[8]),
    );
    is_shape(
        &mut errs,
        "all_to_all_v 2 counts",
        comm.all_to_all_v(a.all(), &[4, 4], r9.buf_mut(0..8), &[8]),
    );
    if let Data::Half(_, b) = &h8 {
        is_shape(&mut errs, "u16 tagged F32", NcclBuf::half(DType::F32, b));
    }
    is_shape(
        &mut errs,
        "rank 1 of 1",
        NcclComm::init(&g, &NcclId::new().unwrap(), 1, 1),
    );
    is_shape(
        &mut errs,
        "0 ranks",
        NcclComm::init(&g, &NcclId::new().unwrap(), 0, 0),
    );
    // The buffers the refused calls named are untouched.
    expect(
        &mut errs,
        "untouched after refusals",
        &r9.values(),
        &[0.0; 9],
    );

    if let Err(e) = comm.async_error() {
        errs.push(format!("async_error on a healthy communicator: {e}"));
    }
    // A second communicator, given up at once.
    let other = NcclComm::init(&g, &NcclId::new().unwrap(), 1, 0).unwrap();
    if let Err(e) = other.abort() {
        errs.push(format!("abort: {e}"));
    }
    g.synchronize().unwrap();
    assert!(errs.is_empty(), "{}", errs.join("\n"));
}

/// ZeRO's collectives over NCCL — the in-place reduce and the in-place all-gather with a
/// count per rank — queued on the communication stream as the executor queues them: behind an
/// event of the compute stream (which uploaded the input) and joined by the compute stream
/// (which downloads the result), the host never waiting in between.
#[test]
fn one_rank_on_the_communication_stream() {
    const T: &str = "one_rank_on_the_communication_stream";
    let Some(g) = gpu(T) else {
        return;
    };
    let id = NcclId::new().unwrap();
    let mut comm = NcclComm::init(&g, &id, 1, 0).unwrap();
    comm.set_stream(Stream::Comm);
    assert_eq!(comm.stream(), Stream::Comm);
    let mut errs = Vec::new();
    let n = 3001;
    let mut last = None;
    for (k, dtype) in TYPES.into_iter().enumerate() {
        let t = format!("{dtype:?} on the communication stream");
        let x = values(dtype, n, 20 + k as u64);
        let mut y = Data::upload(&g, dtype, &x);
        let mut z = Data::upload(&g, dtype, &x);
        let ready = g.record(Stream::Compute).unwrap();
        g.wait_for(Stream::Comm, &ready).unwrap();
        comm.reduce_in_place(y.all_mut(), ReduceOp::Sum, 0).unwrap();
        comm.all_gather_v_in_place(z.all_mut(), &[n]).unwrap();
        let done = g.record(Stream::Comm).unwrap();
        g.wait_for(Stream::Compute, &done).unwrap();
        let sum = reduce_host(dtype, std::slice::from_ref(&x), ReduceOp::Sum);
        expect(
            &mut errs,
            &format!("{t}: reduce in place"),
            &y.values(),
            &sum,
        );
        expect(
            &mut errs,
            &format!("{t}: all_gather_v in place"),
            &z.values(),
            &x,
        );
        is_shape(
            &mut errs,
            &format!("{t}: counts short of the buffer"),
            comm.all_gather_v_in_place(z.all_mut(), &[n - 1]),
        );
        is_shape(
            &mut errs,
            &format!("{t}: two counts for one rank"),
            comm.all_gather_v_in_place(z.all_mut(), &[1, n - 1]),
        );
        last = Some(done);
    }
    g.synchronize().unwrap();
    let done = last.expect("three types");
    done.synchronize().unwrap();
    assert!(
        done.is_done().unwrap(),
        "an event the host waited for is done"
    );
    comm.async_error().unwrap();
    assert!(errs.is_empty(), "{}", errs.join("\n"));
}

/// Rank `rank` of the two-rank test: every collective on GPU `rank`, the mismatches listed.
fn two_rank_body(rank: usize, id: &[u8]) -> Result<Vec<String>, CudaError> {
    let g = Gpu::open(rank)?;
    let id = NcclId::from_bytes(id)?;
    let comm = NcclComm::init(&g, &id, 2, rank)?;
    let other = 1 - rank;
    let mut errs = Vec::new();
    let n = 1000;
    for dtype in TYPES {
        let t = format!("rank {rank} {dtype:?}");
        let inputs: Vec<Vec<f32>> = (0..2).map(|r| quarters(n, r)).collect();
        let xs = Data::upload(&g, dtype, &inputs[rank]);
        for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min, ReduceOp::Avg] {
            let mut out = Data::zeros(&g, dtype, n);
            comm.all_reduce(xs.all(), out.all_mut(), op)?;
            let want = reduce_host(dtype, &inputs, op);
            expect(
                &mut errs,
                &format!("{t} all_reduce {op:?}"),
                &out.values(),
                &want,
            );
        }
        let mut out = Data::zeros(&g, dtype, n);
        comm.reduce(xs.all(), out.all_mut(), ReduceOp::Sum, 1)?;
        if rank == 1 {
            let want = reduce_host(dtype, &inputs, ReduceOp::Sum);
            expect(&mut errs, &format!("{t} reduce to 1"), &out.values(), &want);
        }
        let mut b = Data::upload(&g, dtype, &inputs[rank]);
        comm.broadcast(b.all_mut(), 1)?;
        expect(
            &mut errs,
            &format!("{t} broadcast from 1"),
            &b.values(),
            &inputs[1],
        );

        let mut y = Data::upload(&g, dtype, &inputs[rank]);
        comm.reduce_in_place(y.all_mut(), ReduceOp::Sum, 1)?;
        let want = if rank == 1 {
            reduce_host(dtype, &inputs, ReduceOp::Sum)
        } else {
            inputs[0].clone() // only read
        };
        expect(
            &mut errs,
            &format!("{t} reduce in place to 1"),
            &y.values(),
            &want,
        );

        // Uneven blocks (a ZeRO unit across two shards), this rank's filled on entry.
        let counts = [300usize, n - 300];
        let mine = if rank == 0 { 0..300 } else { 300..n };
        let mut start = vec![0.0; n];
        start[mine.clone()].copy_from_slice(&inputs[rank][mine]);
        let mut z = Data::upload(&g, dtype, &start);
        comm.all_gather_v_in_place(z.all_mut(), &counts)?;
        let want = [&inputs[0][..300], &inputs[1][300..]].concat();
        expect(
            &mut errs,
            &format!("{t} all_gather_v in place"),
            &z.values(),
            &want,
        );

        let mut out = Data::zeros(&g, dtype, 2 * n);
        comm.all_gather(xs.all(), out.all_mut())?;
        expect(
            &mut errs,
            &format!("{t} all_gather"),
            &out.values(),
            &inputs.concat(),
        );

        let mut out = Data::zeros(&g, dtype, n / 2);
        comm.reduce_scatter(xs.all(), out.all_mut(), ReduceOp::Sum)?;
        let sum = reduce_host(dtype, &inputs, ReduceOp::Sum);
        let block = &sum[rank * n / 2..(rank + 1) * n / 2];
        expect(
            &mut errs,
            &format!("{t} reduce_scatter"),
            &out.values(),
            block,
        );

        let mut out = Data::zeros(&g, dtype, n);
        comm.group(|| {
            comm.send(xs.all(), other)?;
            comm.recv(out.all_mut(), other)
        })?;
        expect(
            &mut errs,
            &format!("{t} exchange"),
            &out.values(),
            &inputs[other],
        );

        // counts[r][p]: what rank r sends to rank p (one empty block).
        let counts = [[100usize, 250], [0, 333]];
        let send_counts = counts[rank];
        let recv_counts = [counts[0][rank], counts[1][rank]];
        let sent: usize = send_counts.iter().sum();
        let mut out = Data::zeros(&g, dtype, recv_counts.iter().sum());
        comm.all_to_all_v(xs.buf(0..sent), &send_counts, out.all_mut(), &recv_counts)?;
        let want: Vec<f32> = (0..2)
            .flat_map(|p| {
                let at: usize = counts[p][..rank].iter().sum();
                inputs[p][at..at + counts[p][rank]].to_vec()
            })
            .collect();
        expect(
            &mut errs,
            &format!("{t} all_to_all_v"),
            &out.values(),
            &want,
        );
    }
    comm.async_error()?;
    g.synchronize()?;
    Ok(errs)
}

#[test]
fn two_ranks_one_thread_per_gpu() {
    const T: &str = "two_ranks_one_thread_per_gpu";
    let Some(_g) = gpu(T) else {
        return;
    };
    let count = device_count().unwrap();
    if count < 2 {
        tensor::skip::skip(
            T,
            "multigpu",
            &format!("this machine has {count} GPU; the two-rank NCCL test needs 2"),
        );
        return;
    }
    let id = NcclId::new().unwrap().to_bytes();
    let (tx, rx) = std::sync::mpsc::channel();
    for rank in 0..2 {
        let (id, tx) = (id.clone(), tx.clone());
        std::thread::spawn(move || {
            let r = std::panic::catch_unwind(|| two_rank_body(rank, &id));
            let r = match r {
                Ok(Ok(errs)) => errs,
                Ok(Err(e)) => vec![format!("rank {rank}: {e}")],
                Err(_) => vec![format!("rank {rank} panicked")],
            };
            let _ = tx.send(r);
        });
    }
    drop(tx);
    let mut errs = Vec::new();
    for _ in 0..2 {
        match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(e) => errs.extend(e),
            Err(e) => panic!("a rank did not finish ({e}; waiting inside NCCL?); so far: {errs:?}"),
        }
    }
    assert!(errs.is_empty(), "{}", errs.join("\n"));
}
