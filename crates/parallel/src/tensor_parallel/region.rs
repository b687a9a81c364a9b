//! The Megatron-LM conjugate operators `f` and `g` at the borders of a tensor-parallel region,
//! with and without sequence parallelism. Every TP layer (column / row linear, the block's
//! attention and FFN halves, vocab-parallel embedding and head) communicates only through
//! these four maps, so the collective schedule is defined in one place.
//!
//! | operator                      | tensor parallel       | + sequence parallel          |
//! |-------------------------------|-----------------------|------------------------------|
//! | `enter` forward  (`f`)        | identity              | all-gather tokens            |
//! | `enter` backward (`f*`)       | all-reduce sum        | reduce-scatter tokens        |
//! | `exit` forward   (`g`)        | all-reduce sum        | reduce-scatter tokens        |
//! | `exit` backward  (`g*`)       | identity              | all-gather tokens            |
//!
//! Each backward is the adjoint of its forward: the adjoint of "copy x to every rank" is
//! "sum the ranks' gradients", the adjoint of all-gather is reduce-scatter.
//!
//! Under sequence parallelism each rank holds a contiguous `1/tp` of the flattened `[batch·seq]`
//! token axis in the norm / residual regions (every op there is per token, so which tokens are
//! local does not matter; for `batch = 1` this is exactly Megatron's sequence split).
//!
//! The collectives run over the group's host transports (a GPU activation downloaded, the
//! result uploaded), or, with an NCCL communicator attached ([`TpRegion::attach_nccl`], ranks
//! with a GPU each under `XTRAIN_BACKEND=nccl`), on the devices in the compute stream's order.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use comm::{ProcessGroup, ReduceOp};
use model::layers::block::RegionHooks;
use model::{ModelError, Result};
use tensor::buf::Buf;

use crate::nccl::{NcclGroup, NcclSlot};
use crate::ParallelError;

/// The `f` / `g` operators of one tensor-parallel group.
#[derive(Debug, Clone)]
pub struct TpRegion {
    group: ProcessGroup,
    sp: bool,
    /// Wall time spent inside this group's activation collectives (shared by clones), for the
    /// compute / communication split of a step (over NCCL: the time to queue them).
    comm_nanos: Arc<AtomicU64>,
    /// The group's NCCL communicator, once attached (shared by clones).
    nccl: NcclSlot,
}

impl TpRegion {
    /// Operators over `group` (the tp group), with sequence parallelism when `sp`.
    pub fn new(group: ProcessGroup, sp: bool) -> Self {
        TpRegion {
            group,
            sp,
            comm_nanos: Arc::default(),
            nccl: NcclSlot::default(),
        }
    }

    /// Runs the region's collectives on `nccl` (a communicator over this region's group, on
    /// the compute stream) for activations on a GPU, here and in every clone. Once.
    pub fn attach_nccl(&self, nccl: NcclGroup) -> std::result::Result<(), ParallelError> {
        self.nccl.attach(nccl, self.tp(), "tp")
    }

    /// Nanoseconds spent in collectives issued through this region (and its clones) so far.
    pub fn comm_nanos(&self) -> u64 {
        self.comm_nanos.load(Ordering::Relaxed)
    }

    fn timed<R, E: std::fmt::Display>(
        &self,
        f: impl FnOnce() -> std::result::Result<R, E>,
    ) -> Result<R> {
        let t0 = Instant::now();
        let r = f().map_err(|e| ModelError::Collective(e.to_string()));
        self.comm_nanos
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        r
    }

    /// In-place all-reduce over the group with `op` (timed; a no-op at tp = 1).
    pub fn all_reduce_op(&self, x: &mut [f32], op: ReduceOp) -> Result<()> {
        if self.tp() == 1 {
            return Ok(());
        }
        self.timed(|| self.group.all_reduce(x, op))
    }
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }
    pub fn tp(&self) -> usize {
        self.group.size()
    }
    pub fn rank(&self) -> usize {
        self.group.rank()
    }
    pub fn sequence_parallel(&self) -> bool {
        self.sp
    }

    /// `x ← Σ over the ranks of x`.
    fn all_reduce(&self, x: Buf) -> Result<Buf> {
        match (self.nccl.for_buf(&x), x) {
            (Some(nccl), Buf::Cuda(mut d)) => {
                self.timed(|| nccl.all_reduce_sum(d.as_mut_slice())?.join())?;
                Ok(Buf::Cuda(d))
            }
            (_, x) => x.on_host(|v| self.all_reduce_op(v, ReduceOp::Sum)),
        }
    }

    /// `[x of rank 0, x of rank 1, …]`.
    fn all_gather(&self, x: Buf) -> Result<Buf> {
        if let (Some(nccl), Buf::Cuda(d)) = (self.nccl.for_buf(&x), &x) {
            let mut out = d
                .gpu()
                .alloc::<f32>(d.len() * self.tp())
                .map_err(tensor::TensorError::from)?;
            self.timed(|| nccl.all_gather(d.as_slice(), out.as_mut_slice())?.join())?;
            return Ok(Buf::Cuda(out));
        }
        if self.tp() == 1 {
            return Ok(x);
        }
        let n = x.len() * self.tp();
        x.on_host_into(n, |v, out| self.timed(|| self.group.all_gather(v, out)))
    }

    /// This rank's block of `Σ over the ranks of x`.
    fn reduce_scatter(&self, x: Buf) -> Result<Buf> {
        let n = self.tp();
        if !x.len().is_multiple_of(n) {
            return Err(ModelError::Collective(format!(
                "sequence parallel: {} elements do not split over tp = {n}",
                x.len()
            )));
        }
        if let (Some(nccl), Buf::Cuda(d)) = (self.nccl.for_buf(&x), &x) {
            let mut out = d
                .gpu()
                .alloc::<f32>(d.len() / n)
                .map_err(tensor::TensorError::from)?;
            self.timed(|| {
                nccl.reduce_scatter(d.as_slice(), out.as_mut_slice())?
                    .join()
            })?;
            return Ok(Buf::Cuda(out));
        }
        if n == 1 {
            return Ok(x);
        }
        let len = x.len() / n;
        x.on_host_into(len, |v, out| {
            self.timed(|| self.group.reduce_scatter(v, out, ReduceOp::Sum))
        })
    }

    /// This rank's token range of `tokens` under sequence parallelism (all of them without).
    pub fn local_tokens(&self, tokens: usize) -> std::ops::Range<usize> {
        if self.sp {
            let n = tokens / self.tp();
            self.rank() * n..(self.rank() + 1) * n
        } else {
            0..tokens
        }
    }
}

impl RegionHooks for TpRegion {
    fn enter_forward(&self, x: Buf) -> Result<Buf> {
        if self.sp {
            self.all_gather(x)
        } else {
            Ok(x)
        }
    }
    fn enter_backward(&self, dx: Buf) -> Result<Buf> {
        if self.sp {
            self.reduce_scatter(dx)
        } else {
            self.all_reduce(dx)
        }
    }
    fn exit_forward(&self, y: Buf) -> Result<Buf> {
        if self.sp {
            self.reduce_scatter(y)
        } else {
            self.all_reduce(y)
        }
    }
    fn exit_backward(&self, dy: Buf) -> Result<Buf> {
        if self.sp {
            self.all_gather(dy)
        } else {
            Ok(dy)
        }
    }
}
