//! NCCL communicators over the mesh's groups, for ranks that each have their own GPU
//! (`XTRAIN_BACKEND=nccl`): the group's communication on the devices, with no trip through
//! host memory.
//!
//! - Data parallelism (the executor, `executor::reduce`), on the GPU's communication stream so
//!   that it overlaps the backward's kernels: ZeRO-0/1's bucket all-reduces (fp32, or the fp32
//!   copy of a 16-bit bucket; `1/dp` applied on the compute stream), ZeRO-2/3's reductions of
//!   each piece of a bucket's fp32 staging buffer onto the rank whose shard holds it (which
//!   adds `1/dp` of it to its shard), ZeRO-3's per-unit weight gathers and ZeRO-1/2's gather
//!   of the updated weights, in the weights' own precision
//!   ([`NcclComm::all_gather_v_in_place`]). Each is queued after the compute stream's work so
//!   far (an event the communication stream waits for) and returns an [`InFlight`], which the
//!   executor joins before it reads the result (the compute stream waits for the collective's
//!   event; the host does not), keeping the buffers it uses alive until then.
//! - Context parallelism (`context_parallel::ring`), on the communication stream: the ring's
//!   shifts of K/V blocks and of their gradient sums (a send to the next rank grouped with the
//!   receive from the previous one), overlapping the block's attention kernels, or the
//!   all-gather and reduce-scatter of the all-gather variant.
//! - Tensor parallelism (`tensor_parallel::region`): the region operators' all-reduce,
//!   all-gather and reduce-scatter of activations and their gradients, on the compute stream
//!   (the model needs each result before its next kernel: stream order is the whole
//!   synchronisation, and the host never waits).
//!
//! - Pipeline parallelism (`pipeline_parallel::link`): each link's activations or gradients
//!   between two stages, on a communicator of the link's two ranks and a side stream of its
//!   own, so that a message waiting for its peer never holds up another link's.
//!
//! - Expert parallelism (`expert_parallel`): the all-to-alls of the token rows to the
//!   experts' ranks and of the outputs back (forward) and of their gradients (backward), on
//!   the communication stream, overlapping the shared expert; the row counts go first over
//!   the host.
//!
//! The rest (compressed or PowerSGD reductions, tied embeddings, expert parallelism's prepared
//! reductions) keeps the communicator's
//! collectives over host memory (`XTRAIN_BACKEND=own`, the default, or `mpi`).
//!
//! A communicator is made over a process group: every rank reports its host and GPU (NCCL
//! needs one GPU per rank, so ranks sharing one are refused by name before NCCL is asked),
//! rank 0 makes the unique id and broadcasts it over the group's authenticated host transport,
//! and every rank joins. Every rank makes its communicators in the same order (dp, tp, cp, ep,
//! then the pipeline's links by stage boundary).
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

use comm::ProcessGroup;
use tensor::cuda::{
    DevSlice, DevSliceMut, Event, Gpu, NcclBufMut, NcclComm, NcclId, ReduceOp, Stream,
};

use crate::ParallelError;

/// Environment variable choosing how GPU ranks communicate.
pub const BACKEND_ENV: &str = "XTRAIN_BACKEND";

/// How GPU ranks communicate.
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

/// An NCCL communicator over a process group (shared by its users' clones).
#[derive(Clone)]
pub struct NcclGroup {
    comm: Arc<Mutex<NcclComm>>,
    size: usize,
    /// The process group's name and this rank in it, for errors.
    name: Arc<str>,
    rank: usize,
}

/// A group's background NCCL error seen from outside it ([`NcclGroup::watcher`]): the GPU's
/// watch lives as long as the process, the communicators only as long as the job that made
/// them (a group gone reports nothing).
#[derive(Clone, Debug)]
pub struct NcclWatcher {
    comm: std::sync::Weak<Mutex<NcclComm>>,
    describe: String,
}

impl NcclWatcher {
    /// The group's background error as text naming it and the rank; `Ok` once it is gone.
    pub fn check(&self) -> Result<(), String> {
        let Some(comm) = self.comm.upgrade() else {
            return Ok(());
        };
        let comm = comm.lock().unwrap_or_else(|p| p.into_inner());
        comm.async_error()
            .map_err(|e| format!("{}: {e}", self.describe))
    }

    /// "NCCL on group … (rank r of n)".
    pub fn describe(&self) -> &str {
        &self.describe
    }
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclGroup({}, {} ranks)", self.name, self.size)
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
    /// Joins every rank of `group` (each on its `gpu`) into one NCCL communicator whose
    /// collectives are queued on `stream`; `what` names the traffic in the log line. A
    /// collective over `group`: every rank calls it.
    pub fn new(
        group: &ProcessGroup,
        gpu: &Arc<Gpu>,
        stream: Stream,
        what: &str,
    ) -> Result<NcclGroup, ParallelError> {
        let (n, me) = (group.size(), group.rank());
        let mine = [fnv1a(&host_name()), gpu.info.ordinal as i64];
        let mut all = vec![0i64; 2 * n];
        group.all_gather(&mine, &mut all)?;
        for a in 0..n {
            for b in a + 1..n {
                if all[2 * a..2 * a + 2] == all[2 * b..2 * b + 2] {
                    return Err(ParallelError::Config(format!(
                        "{BACKEND_ENV}=nccl needs one GPU per rank, but ranks {a} and {b} of group {} share cuda:{} on one host (start at most as many ranks per host as it has GPUs, or use {BACKEND_ENV}=own)",
                        group.name(),
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
        group.broadcast(&mut words, 0)?;
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let id = NcclId::from_bytes(&bytes).map_err(cuda_err)?;
        let mut comm = NcclComm::init(gpu, &id, n, me).map_err(cuda_err)?;
        comm.set_stream(stream);
        tracing::info!(target: "comm", "group {} of {n} ranks: {what} over NCCL on cuda:{} ({stream:?} stream)", group.name(), gpu.info.ordinal);
        Ok(NcclGroup {
            comm: Arc::new(Mutex::new(comm)),
            size: n,
            name: group.name().into(),
            rank: me,
        })
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// `NCCL on group <name> (rank r of n)`, for errors and a GPU's [`tensor::cuda::Watch`].
    pub fn describe(&self) -> String {
        format!(
            "NCCL on group {} (rank {} of {})",
            self.name, self.rank, self.size
        )
    }

    /// An error NCCL met in the background (a peer that failed, a broken connection), as
    /// text naming the group and the rank.
    pub fn check(&self) -> Result<(), String> {
        self.watcher().check()
    }

    /// What the GPU's watch of host waits holds ([`NcclWatcher`]): this group's background
    /// error, without keeping its communicator alive.
    pub fn watcher(&self) -> NcclWatcher {
        NcclWatcher {
            comm: Arc::downgrade(&self.comm),
            describe: self.describe(),
        }
    }

    fn comm(&self) -> MutexGuard<'_, NcclComm> {
        self.comm.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues `f`'s collectives on the communicator's stream: on the communication stream (or
    /// a side stream) after the compute stream's work so far, with an event to join; on the
    /// compute stream in its order (nothing to join).
    ///
    /// An error NCCL met in the background since the last call (a peer that failed, a broken
    /// connection) is reported here, naming the group and the rank, instead of queueing work
    /// that would wait for that peer forever.
    fn queue(
        &self,
        f: impl FnOnce(&NcclComm) -> Result<(), tensor::cuda::CudaError>,
    ) -> Result<InFlight, ParallelError> {
        let comm = self.comm();
        let err = |e: tensor::cuda::CudaError| {
            ParallelError::Collective(format!("{}: {e}", self.describe()))
        };
        comm.async_error().map_err(err)?;
        let gpu = comm.gpu().clone();
        if comm.stream() == Stream::Compute {
            f(&comm).map_err(err)?;
            return Ok(InFlight { done: None, gpu });
        }
        let ready = gpu.record(Stream::Compute).map_err(err)?;
        gpu.wait_for(comm.stream(), &ready).map_err(err)?;
        f(&comm).map_err(err)?;
        let done = gpu.record(comm.stream()).map_err(err)?;
        Ok(InFlight {
            done: Some(done),
            gpu,
        })
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

    /// Starts `recv = [send of rank 0, send of rank 1, …]` (fp32; `recv` is `size` times
    /// `send`).
    pub fn all_gather(
        &self,
        send: DevSlice<'_, f32>,
        recv: DevSliceMut<'_, f32>,
    ) -> Result<InFlight, ParallelError> {
        self.queue(|c| c.all_gather(send, recv))
    }

    /// Starts `recv` = this rank's block of the sum over the ranks of `send` (fp32; `send` is
    /// `size` times `recv`).
    pub fn reduce_scatter(
        &self,
        send: DevSlice<'_, f32>,
        recv: DevSliceMut<'_, f32>,
    ) -> Result<InFlight, ParallelError> {
        self.queue(|c| c.reduce_scatter(send, recv, ReduceOp::Sum))
    }

    /// Starts sending `send` to rank `to` while receiving `recv` from rank `from`, grouped (so
    /// that a ring of such exchanges cannot wait on itself).
    pub fn send_recv(
        &self,
        send: DevSlice<'_, f32>,
        to: usize,
        recv: DevSliceMut<'_, f32>,
        from: usize,
    ) -> Result<InFlight, ParallelError> {
        self.queue(|c| {
            c.group(|| {
                c.send(send, to)?;
                c.recv(recv, from)
            })
        })
    }

    /// Starts sending `send` to rank `to` (fp32): the matching [`NcclGroup::recv`] on `to` is
    /// the next one it posts from this rank on this communicator (NCCL's point-to-point
    /// messages between two ranks arrive in the order they were sent).
    pub fn send(&self, send: DevSlice<'_, f32>, to: usize) -> Result<InFlight, ParallelError> {
        self.queue(|c| c.send(send, to))
    }

    /// Starts receiving `recv` from rank `from` (fp32; see [`NcclGroup::send`]).
    pub fn recv(&self, recv: DevSliceMut<'_, f32>, from: usize) -> Result<InFlight, ParallelError> {
        self.queue(|c| c.recv(recv, from))
    }

    /// Starts an all-to-all with counts per rank (fp32): `send` holds `send_counts[p]`
    /// elements for each rank p, rank after rank; `recv` gets `recv_counts[p]` from each rank
    /// p, rank after rank (grouped sends and receives).
    pub fn all_to_all_v(
        &self,
        send: DevSlice<'_, f32>,
        send_counts: &[usize],
        recv: DevSliceMut<'_, f32>,
        recv_counts: &[usize],
    ) -> Result<InFlight, ParallelError> {
        self.queue(|c| c.all_to_all_v(send, send_counts, recv, recv_counts))
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

/// Where a layer keeps the NCCL communicator of its group once one is attached (shared by its
/// clones): the region operators of tensor parallelism, the ring of context parallelism.
#[derive(Clone, Debug, Default)]
pub struct NcclSlot(Arc<OnceLock<NcclGroup>>);

impl NcclSlot {
    /// Attaches `nccl`, a communicator over the `what` group of `size` ranks. Once.
    pub fn attach(&self, nccl: NcclGroup, size: usize, what: &str) -> Result<(), ParallelError> {
        if nccl.size() != size {
            return Err(ParallelError::Config(format!(
                "an NCCL communicator of {} ranks for a {what} group of {size}",
                nccl.size()
            )));
        }
        self.0.set(nccl).map_err(|_| {
            ParallelError::Config(format!(
                "the {what} group already has its NCCL communicator"
            ))
        })
    }

    /// The communicator, where one is attached and `x` lies on a GPU.
    pub fn for_buf(&self, x: &tensor::buf::Buf) -> Option<&NcclGroup> {
        self.0
            .get()
            .filter(|_| matches!(x, tensor::buf::Buf::Cuda(_)))
    }
}

/// A queued collective. On the communication stream its buffers stay alive until it is
/// joined (the caller holds them: the allocator knows the compute stream only); on the
/// compute stream it is ordered already and joining does nothing.
#[must_use = "a collective in flight is joined before its result is read"]
pub struct InFlight {
    done: Option<Event>,
    gpu: Arc<Gpu>,
}

impl InFlight {
    /// Whether it finished, as far as the compute stream is concerned (the host does not
    /// wait; an error counts as finished, for [`InFlight::join`] to report).
    pub fn is_done(&self) -> bool {
        self.done
            .as_ref()
            .is_none_or(|d| d.is_done().unwrap_or(true))
    }

    /// Orders the compute stream after the collective: kernels queued from now on see its
    /// results, and the buffers it used may be freed (the host does not wait).
    pub fn join(self) -> Result<(), ParallelError> {
        match &self.done {
            Some(done) => self.gpu.wait_for(Stream::Compute, done).map_err(cuda_err),
            None => Ok(()),
        }
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
