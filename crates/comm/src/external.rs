//! An external library that runs a group's operations instead of the own engine: the MPI
//! backend, which lives in the `comm-mpi` crate so that building it (it needs the system's MPI
//! library) recompiles that crate and the binary only, never this crate or the ones above it.
//!
//! The library registers its entry points once per process ([`register`]);
//! `XTRAIN_BACKEND=mpi` then builds the world from it
//! ([`crate::Communicator::init_mpi`]), and every group's operations reach its
//! [`ExternalGroup`] on type-erased buffers — bytes and their [`DType`] — through the adapters
//! below, which check the arguments against the group first (the own engine's rules,
//! `arg_check`) and apply [`ReduceOp::Avg`] themselves (the library sums, then each element is
//! divided by the group size here, as the own engine does).
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use crate::arg_check;
use crate::collectives::AllReduceAlgo;
use crate::element::{DType, Element, ReduceOp};
use crate::engine::Counters;
use crate::error::Result;
use crate::wire::OpKind;

/// Counts a group's operations and the bytes it sends, into its statistics
/// ([`crate::CommStats`]).
#[derive(Clone, Debug)]
pub struct OpCounter(pub(crate) Arc<Counters>);

impl OpCounter {
    /// One operation of `kind` that sent `bytes`.
    pub fn count(&self, kind: OpKind, bytes: usize) {
        self.0.ops[kind.index()].fetch_add(1, Ordering::Relaxed);
        self.0.bytes[kind.index()].fetch_add(bytes as u64, Ordering::Relaxed);
    }
}

/// A group's communicator in the external library. Buffers are elements of `dtype` as bytes,
/// their lengths already checked against the group; reductions get [`ReduceOp::Sum`], `Max` or
/// `Min` (an average is a sum the adapter divides). One call at a time (the group's mutex).
pub trait ExternalGroup: Send {
    fn size(&self) -> usize;
    fn rank(&self) -> usize;
    /// The group's name (`dp[0,2]`), for errors.
    fn name(&self) -> &str;
    fn p2p(
        &mut self,
        dtype: DType,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        tag: u32,
    ) -> Result<()>;
    fn all_reduce(&mut self, dtype: DType, buf: &mut [u8], op: ReduceOp) -> Result<()>;
    /// `buf` becomes the result on `root` only.
    fn reduce(&mut self, dtype: DType, buf: &mut [u8], op: ReduceOp, root: usize) -> Result<()>;
    fn broadcast(&mut self, dtype: DType, buf: &mut [u8], root: usize) -> Result<()>;
    /// `output` gets this rank's shard ([`crate::shard_range`]) of the reduced `input`.
    fn reduce_scatter(
        &mut self,
        dtype: DType,
        input: &[u8],
        output: &mut [u8],
        op: ReduceOp,
    ) -> Result<()>;
    fn all_gather(&mut self, dtype: DType, input: &[u8], output: &mut [u8]) -> Result<()>;
    /// Every rank's `input` in rank order (bytes), and each rank's element count.
    fn all_gather_v(&mut self, dtype: DType, input: &[u8]) -> Result<(Vec<u8>, Vec<usize>)>;
    /// `output` is `Some` on `root` only.
    fn gather(
        &mut self,
        dtype: DType,
        input: &[u8],
        output: Option<&mut [u8]>,
        root: usize,
    ) -> Result<()>;
    /// `input` is `Some` on `root` only.
    fn scatter(
        &mut self,
        dtype: DType,
        input: Option<&[u8]>,
        output: &mut [u8],
        root: usize,
    ) -> Result<()>;
    fn all_to_all(&mut self, dtype: DType, input: &[u8], output: &mut [u8]) -> Result<()>;
    /// `send_counts` in elements per rank; the received bytes in rank order, and the element
    /// count from each rank.
    fn all_to_all_v(
        &mut self,
        dtype: DType,
        input: &[u8],
        send_counts: &[usize],
    ) -> Result<(Vec<u8>, Vec<usize>)>;
    fn barrier(&mut self) -> Result<()>;
    /// Refuses further operations, naming `reason`.
    fn abort(&mut self, reason: String);
}

/// The library's world: its processes, which make the groups' communicators.
pub trait ExternalWorld: Send + Sync {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Every rank's `host` (collective over the world).
    fn all_hosts(&self, host: &str) -> Result<Vec<String>>;
    /// The communicator of `members` (world ranks in group order; this rank is `rank` among
    /// them), collective over the members only: `tag` tells apart creations that may overlap,
    /// `name` goes into errors, `counter` takes its statistics.
    fn create(
        &self,
        members: &[usize],
        rank: usize,
        tag: i32,
        name: &str,
        counter: OpCounter,
    ) -> Result<Box<dyn ExternalGroup>>;
}

/// An external library's entry points.
pub struct ExternalLibrary {
    /// Joins the library's world (initialising the library once per process).
    pub init: fn() -> Result<Arc<dyn ExternalWorld>>,
    /// Ends the library at the end of a successful run (a no-op where it was not started).
    pub finalize: fn(),
    /// The library's version line.
    pub version: fn() -> String,
}

static LIBRARY: OnceLock<ExternalLibrary> = OnceLock::new();

/// Makes `XTRAIN_BACKEND=mpi` run on `library`. Once per process: a later call changes nothing.
pub fn register(library: ExternalLibrary) {
    let _ = LIBRARY.set(library);
}

/// The registered library, if any.
pub(crate) fn library() -> Option<&'static ExternalLibrary> {
    LIBRARY.get()
}

// The adapters: `ProcessGroup`'s typed operations onto an `ExternalGroup` (called by
// `backend::Backend`'s dispatch, argument for argument).

fn summed(op: ReduceOp) -> ReduceOp {
    if op == ReduceOp::Avg {
        ReduceOp::Sum
    } else {
        op
    }
}

fn scale_avg<T: Element>(op: ReduceOp, buf: &mut [T], n: usize) {
    if op == ReduceOp::Avg {
        for x in buf {
            *x = x.div_n(n);
        }
    }
}

fn bytes<T: Element>(s: &[T]) -> &[u8] {
    bytemuck::cast_slice(s)
}

fn bytes_mut<T: Element>(s: &mut [T]) -> &mut [u8] {
    bytemuck::cast_slice_mut(s)
}

/// Elements from their bytes (a copy: the bytes need not be aligned for `T`).
fn from_bytes<T: Element>(b: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); b.len() / std::mem::size_of::<T>()];
    bytes_mut(&mut v).copy_from_slice(b);
    v
}

pub(crate) fn p2p<T: Element>(
    g: &mut dyn ExternalGroup,
    sends: &[(usize, &[T])],
    recvs: &mut [(usize, &mut [T])],
    tag: u32,
) -> Result<()> {
    let sends: Vec<(usize, &[u8])> = sends.iter().map(|(p, b)| (*p, bytes(b))).collect();
    let mut recvs: Vec<(usize, &mut [u8])> =
        recvs.iter_mut().map(|(p, b)| (*p, bytes_mut(b))).collect();
    g.p2p(T::DTYPE, &sends, &mut recvs, tag)
}

pub(crate) fn all_reduce<T: Element>(
    g: &mut dyn ExternalGroup,
    buf: &mut [T],
    op: ReduceOp,
    _algo: AllReduceAlgo,
) -> Result<()> {
    g.all_reduce(T::DTYPE, bytes_mut(buf), summed(op))?;
    scale_avg(op, buf, g.size());
    Ok(())
}

pub(crate) fn reduce<T: Element>(
    g: &mut dyn ExternalGroup,
    buf: &mut [T],
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    arg_check::root("reduce", g.name(), g.size(), root)?;
    g.reduce(T::DTYPE, bytes_mut(buf), summed(op), root)?;
    if g.rank() == root {
        scale_avg(op, buf, g.size());
    }
    Ok(())
}

pub(crate) fn broadcast<T: Element>(
    g: &mut dyn ExternalGroup,
    buf: &mut [T],
    root: usize,
) -> Result<()> {
    arg_check::root("broadcast", g.name(), g.size(), root)?;
    g.broadcast(T::DTYPE, bytes_mut(buf), root)
}

pub(crate) fn reduce_scatter<T: Element>(
    g: &mut dyn ExternalGroup,
    input: &[T],
    output: &mut [T],
    op: ReduceOp,
) -> Result<()> {
    arg_check::reduce_scatter(g.size(), g.rank(), input.len(), output.len())?;
    g.reduce_scatter(T::DTYPE, bytes(input), bytes_mut(output), summed(op))?;
    scale_avg(op, output, g.size());
    Ok(())
}

pub(crate) fn all_gather<T: Element>(
    g: &mut dyn ExternalGroup,
    input: &[T],
    output: &mut [T],
) -> Result<()> {
    arg_check::all_gather(g.size(), input.len(), output.len())?;
    g.all_gather(T::DTYPE, bytes(input), bytes_mut(output))
}

pub(crate) fn all_gather_v<T: Element>(
    g: &mut dyn ExternalGroup,
    input: &[T],
) -> Result<(Vec<T>, Vec<usize>)> {
    let (out, counts) = g.all_gather_v(T::DTYPE, bytes(input))?;
    Ok((from_bytes(&out), counts))
}

/// [`all_gather_v`] into `output` (the library's result copied; a wrong length an error
/// after the collective, as on the own engine).
pub(crate) fn all_gather_v_into<T: Element>(
    g: &mut dyn ExternalGroup,
    input: &[T],
    output: &mut [T],
) -> Result<Vec<usize>> {
    let (out, counts) = all_gather_v(g, input)?;
    copy_whole("all_gather_v", out, output)?;
    Ok(counts)
}

/// A collective's result `out` into the caller's `output` of the same length.
fn copy_whole<T: Element>(op: &str, out: Vec<T>, output: &mut [T]) -> Result<()> {
    arg_check::received_into(op, output.len(), out.len())?;
    output.copy_from_slice(&out);
    Ok(())
}

pub(crate) fn gather<T: Element>(
    g: &mut dyn ExternalGroup,
    input: &[T],
    output: Option<&mut [T]>,
    root: usize,
) -> Result<()> {
    arg_check::root("gather", g.name(), g.size(), root)?;
    let output = match g.rank() == root {
        true => Some(bytes_mut(arg_check::root_blocks(
            "gather",
            "output",
            g.size(),
            input.len(),
            output,
        )?)),
        false => None,
    };
    g.gather(T::DTYPE, bytes(input), output, root)
}

pub(crate) fn scatter<T: Element>(
    g: &mut dyn ExternalGroup,
    input: Option<&[T]>,
    output: &mut [T],
    root: usize,
) -> Result<()> {
    arg_check::root("scatter", g.name(), g.size(), root)?;
    let input = match g.rank() == root {
        true => Some(bytes(arg_check::root_blocks(
            "scatter",
            "input",
            g.size(),
            output.len(),
            input,
        )?)),
        false => None,
    };
    g.scatter(T::DTYPE, input, bytes_mut(output), root)
}

pub(crate) fn all_to_all<T: Element>(
    g: &mut dyn ExternalGroup,
    input: &[T],
    output: &mut [T],
) -> Result<()> {
    arg_check::all_to_all(g.size(), input.len(), output.len())?;
    g.all_to_all(T::DTYPE, bytes(input), bytes_mut(output))
}

pub(crate) fn all_to_all_v<T: Element>(
    g: &mut dyn ExternalGroup,
    input: &[T],
    send_counts: &[usize],
) -> Result<(Vec<T>, Vec<usize>)> {
    arg_check::all_to_all_v(g.size(), input.len(), send_counts)?;
    let (out, counts) = g.all_to_all_v(T::DTYPE, bytes(input), send_counts)?;
    Ok((from_bytes(&out), counts))
}

/// [`all_to_all_v`] into `output` (as [`all_gather_v_into`]).
pub(crate) fn all_to_all_v_into<T: Element>(
    g: &mut dyn ExternalGroup,
    input: &[T],
    send_counts: &[usize],
    output: &mut [T],
) -> Result<Vec<usize>> {
    let (out, counts) = all_to_all_v(g, input, send_counts)?;
    copy_whole("all_to_all_v", out, output)?;
    Ok(counts)
}
