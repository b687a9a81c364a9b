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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use comm::{ProcessGroup, ReduceOp};
use model::layers::block::RegionHooks;
use model::{ModelError, Result};

/// The `f` / `g` operators of one tensor-parallel group.
#[derive(Debug, Clone)]
pub struct TpRegion {
    group: ProcessGroup,
    sp: bool,
    /// Wall time spent inside this group's activation collectives (shared by clones), for the
    /// compute / communication split of a step.
    comm_nanos: Arc<AtomicU64>,
}

fn cerr(e: comm::CommError) -> ModelError {
    ModelError::Collective(e.to_string())
}

impl TpRegion {
    /// Operators over `group` (the tp group), with sequence parallelism when `sp`.
    pub fn new(group: ProcessGroup, sp: bool) -> Self {
        TpRegion {
            group,
            sp,
            comm_nanos: Arc::default(),
        }
    }

    /// Nanoseconds spent in collectives issued through this region (and its clones) so far.
    pub fn comm_nanos(&self) -> u64 {
        self.comm_nanos.load(Ordering::Relaxed)
    }

    fn timed<R>(&self, f: impl FnOnce() -> comm::Result<R>) -> Result<R> {
        let t0 = Instant::now();
        let r = f().map_err(cerr);
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

    fn all_reduce(&self, mut x: Vec<f32>) -> Result<Vec<f32>> {
        self.all_reduce_op(&mut x, ReduceOp::Sum)?;
        Ok(x)
    }

    fn all_gather(&self, x: Vec<f32>) -> Result<Vec<f32>> {
        if self.tp() == 1 {
            return Ok(x);
        }
        let mut out = vec![0.0; x.len() * self.tp()];
        self.timed(|| self.group.all_gather(&x, &mut out))?;
        Ok(out)
    }

    fn reduce_scatter(&self, x: Vec<f32>) -> Result<Vec<f32>> {
        let n = self.tp();
        if n == 1 {
            return Ok(x);
        }
        if !x.len().is_multiple_of(n) {
            return Err(ModelError::Collective(format!(
                "sequence parallel: {} elements do not split over tp = {n}",
                x.len()
            )));
        }
        let mut out = vec![0.0; x.len() / n];
        self.timed(|| self.group.reduce_scatter(&x, &mut out, ReduceOp::Sum))?;
        Ok(out)
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
    fn enter_forward(&self, x: Vec<f32>) -> Result<Vec<f32>> {
        if self.sp {
            self.all_gather(x)
        } else {
            Ok(x)
        }
    }
    fn enter_backward(&self, dx: Vec<f32>) -> Result<Vec<f32>> {
        if self.sp {
            self.reduce_scatter(dx)
        } else {
            self.all_reduce(dx)
        }
    }
    fn exit_forward(&self, y: Vec<f32>) -> Result<Vec<f32>> {
        if self.sp {
            self.reduce_scatter(y)
        } else {
            self.all_reduce(y)
        }
    }
    fn exit_backward(&self, dy: Vec<f32>) -> Result<Vec<f32>> {
        if self.sp {
            self.all_gather(dy)
        } else {
            Ok(dy)
        }
    }
}
