//! NCCL for the data-parallel communication of ranks that each have their own GPU
//! (`XTRAIN_BACKEND=nccl`), on the device, with no trip through host memory, on the GPU's
//! communication stream so that it overlaps the backward's kernels:
//! - ZeRO-0/1: a bucket of fp32 gradients (or the fp32 copy of a 16-bit bucket) all-reduced
//!   in place, then scaled by `1/dp` on the compute stream;
//! - ZeRO-2/3: each piece of a bucket's fp32 staging buffer summed in place onto the rank
//!   whose shard holds it (`ncclReduce`), which adds `1/dp` of it to its gradient shard;
//! - ZeRO-3's per-unit weight gathers, and ZeRO-1/2's gather of the updated weights after the
//!   optimizer step, in the weights' own precision ([`NcclComm::all_gather_v_in_place`]).
//!
//! Each is queued after the compute stream's work so far (an event the communication stream
//! waits for) and returns an [`InFlight`]; the executor joins it before it reads the result
//! (the compute stream waits for the collective's event; the host does not) and keeps the
//! buffers it uses alive until then. The rest of the executor (compressed or PowerSGD
//! reductions, tied embeddings, expert parallelism's prepared reductions, pipeline messages,
//! the model's collectives) keeps the communicator's collectives over host memory
//! (`XTRAIN_BACKEND=own`, the default, or `mpi`).
//!
//! The communicator is made over the dp group itself: every rank reports its host and GPU
//! (NCCL needs one GPU per rank, so ranks sharing one are refused by name before NCCL is
//! asked), rank 0 makes the unique id and broadcasts it over the group's authenticated host
//! transport, and every rank joins.
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};

use comm::ProcessGroup;
use tensor::cuda::{DevSliceMut, Event, Gpu, NcclBufMut, NcclComm, NcclId, ReduceOp, Stream};

use crate::ParallelError;

/// Environment variable choosing the data-parallel backend of GPU ranks.
pub const BACKEND_ENV: &str = "XTRAIN_BACKEND";

/// The data-parallel backend of GPU ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Through host memory, on the collectives of the communicator (`XTRAIN_BACKEND` `own`
    /// or `mpi`: any number of ranks per GPU).
    Host,
    /// NCCL on the device (`XTRAIN_BACKEND=nccl`: one GPU per rank).
    Nccl,
}

impl Backend {
    /// From `XTRAIN_BACKEND` (unset: through host memory).
    pub fn from_env() -> Result<Backend, ParallelError> {
        Backend::parse(&std::env::var(BACKEND_ENV).unwrap_or_default())
    }

    /// `own`, `mpi` (the host collectives' library) or `nccl` (empty: `own`).
    pub fn parse(v: &str) -> Result<Backend, ParallelError> {
        match v.trim().to_ascii_lowercase().as_str() {
            "" | "own" | "mpi" => Ok(Backend::Host),
            "nccl" => Ok(Backend::Nccl),
            other => Err(ParallelError::Config(format!(
                "{BACKEND_ENV}={other}: expected own, mpi or nccl"
            ))),
        }
    }
}

/// An NCCL communicator over a dp group (shared by the executor's clones of its config).
#[derive(Clone)]
pub struct NcclGroup {
    comm: Arc<Mutex<NcclComm>>,
    size: usize,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclGroup({} ranks)", self.size)
    }
}

fn cuda_err(e: tensor::cuda::CudaError) -> ParallelError {
    ParallelError::Model(format!("NCCL: {e}"))
}

/// This machine's name (ranks on one host with the same GPU ordinal share that GPU).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// A 64-bit FNV-1a hash of `s` (the host name travels as one integer).
fn fnv1a(s: &str) -> i64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    }) as i64
}

impl NcclGroup {
    /// Joins every rank of `dp` (each on its `gpu`) into one NCCL communicator. A
    /// collective over `dp`: every rank calls it.
    pub fn new(dp: &ProcessGroup, gpu: &Arc<Gpu>) -> Result<NcclGroup, ParallelError> {
        let (n, me) = (dp.size(), dp.rank());
        let mine = [fnv1a(&host_name()), gpu.info.ordinal as i64];
        let mut all = vec![0i64; 2 * n];
        dp.all_gather(&mine, &mut all)?;
        for a in 0..n {
            for b in a + 1..n {
                if all[2 * a..2 * a + 2] == all[2 * b..2 * b + 2] {
                    return Err(ParallelError::Config(format!(
                        "{BACKEND_ENV}=nccl needs one GPU per rank, but dp ranks {a} and {b} share cuda:{} on one host (start at most as many ranks per host as it has GPUs, or use {BACKEND_ENV}=own)",
                        all[2 * a + 1]
                    )));
                }
            }
        }
        // The id as 16 words over the group's own (authenticated) transport.
        let mut words = [0i64; NcclId::BYTES / 8];
        if me == 0 {
            let id = NcclId::new().map_err(cuda_err)?;
            for (w, c) in words.iter_mut().zip(id.as_bytes().chunks_exact(8)) {
                *w = i64::from_le_bytes(c.try_into().expect("8 bytes"));
            }
        }
        dp.broadcast(&mut words, 0)?;
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let id = NcclId::from_bytes(&bytes).map_err(cuda_err)?;
        let mut comm = NcclComm::init(gpu, &id, n, me).map_err(cuda_err)?;
        comm.set_stream(Stream::Comm);
        tracing::info!(target: "comm", "dp group of {n} ranks: gradient reductions and ZeRO weight gathers over NCCL on cuda:{} (communication stream)", gpu.info.ordinal);
        Ok(NcclGroup {
            comm: Arc::new(Mutex::new(comm)),
            size: n,
        })
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    fn comm(&self) -> MutexGuard<'_, NcclComm> {
        self.comm.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `f`'s collectives on the communication stream after the compute stream's work
    /// so far.
    fn queue(
        &self,
        f: impl FnOnce(&NcclComm) -> Result<(), tensor::cuda::CudaError>,
    ) -> Result<InFlight, ParallelError> {
        let comm = self.comm();
        let gpu = comm.gpu().clone();
        let ready = gpu.record(Stream::Compute).map_err(cuda_err)?;
        gpu.wait_for(Stream::Comm, &ready).map_err(cuda_err)?;
        f(&comm).map_err(cuda_err)?;
        let done = gpu.record(Stream::Comm).map_err(cuda_err)?;
        Ok(InFlight { done, gpu })
    }

    /// Starts `g ← Σ over the ranks of g`, in place (fp32); the mean's `· 1/n` is the
    /// caller's, after [`InFlight::join`] (the own engine's order of operations, so the
    /// rounding rule is the same).
    pub fn all_reduce_sum(&self, g: DevSliceMut<'_, f32>) -> Result<InFlight, ParallelError> {
        self.queue(|c| c.all_reduce_in_place(g, ReduceOp::Sum))
    }

    /// Starts summing the `pieces` of `g` (ranges of `g`, each with the rank that owns it)
    /// onto their owners, in place: an owner's piece becomes the sum over the ranks; the
    /// others' pieces are only read.
    pub fn reduce_pieces(
        &self,
        mut g: DevSliceMut<'_, f32>,
        pieces: &[(usize, Range<usize>)],
    ) -> Result<InFlight, ParallelError> {
        self.queue(|c| {
            for (root, r) in pieces {
                c.reduce_in_place(g.reborrow().slice_mut(r.clone()), ReduceOp::Sum, *root)?;
            }
            Ok(())
        })
    }

    /// Starts gathering `buf` in place from its blocks: `counts[p]` elements from rank `p`,
    /// in rank order; this rank's block is filled before the call.
    pub fn all_gather_v(
        &self,
        buf: NcclBufMut<'_>,
        counts: &[usize],
    ) -> Result<InFlight, ParallelError> {
        self.queue(|c| c.all_gather_v_in_place(buf, counts))
    }
}

/// A collective queued on the communication stream. Its buffers stay alive until it is
/// joined (the caller holds them: the allocator knows the compute stream only).
#[must_use = "a collective in flight is joined before its result is read"]
pub struct InFlight {
    done: Event,
    gpu: Arc<Gpu>,
}

impl InFlight {
    /// Whether it finished (the host does not wait; an error counts as finished, for
    /// [`InFlight::join`] to report).
    pub fn is_done(&self) -> bool {
        self.done.is_done().unwrap_or(true)
    }

    /// Orders the compute stream after the collective: kernels queued from now on see its
    /// results, and the buffers it used may be freed (the host does not wait).
    pub fn join(self) -> Result<(), ParallelError> {
        self.gpu
            .wait_for(Stream::Compute, &self.done)
            .map_err(cuda_err)
    }
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "InFlight({:?})", self.done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_parse_and_hosts_hash_apart() {
        assert_eq!(Backend::parse("").unwrap(), Backend::Host);
        assert_eq!(Backend::parse(" OWN ").unwrap(), Backend::Host);
        assert_eq!(Backend::parse("mpi").unwrap(), Backend::Host);
        assert_eq!(Backend::parse("nccl").unwrap(), Backend::Nccl);
        let e = Backend::parse("gloo").unwrap_err().to_string();
        assert!(
            e.contains("XTRAIN_BACKEND=gloo") && e.contains("own, mpi or nccl"),
            "{e}"
        );
        assert_ne!(fnv1a("node-a"), fnv1a("node-b"));
        assert_eq!(fnv1a("node-a"), fnv1a("node-a"));
    }
}
