//! NCCL communicators between GPUs and their collectives on device buffers.
//!
//! This module owns the communicator ([`NcclComm`]: created from an [`NcclId`] every rank is
//! given, destroyed on drop, aborted where a peer failed), the element views the collectives
//! take ([`NcclBuf`], [`NcclBufMut`]: fp32, bf16 or fp16, the 16-bit types either as
//! `half::bf16` / `half::f16` buffers or as the `u16` bit patterns the engine stores, with their
//! [`DType`]) and the checks made before NCCL is called (lengths, roots and peers, element
//! types, the device), each a [`CudaError::Shape`] naming the call. NCCL itself (`libnccl.so.2`)
//! is opened at run time by [`sys::nccl`], like the CUDA libraries; a missing NCCL is a
//! [`CudaError::Library`] saying where it was looked for and what to do.
//!
//! Stream semantics: every collective is *queued* on the [`Gpu`]'s compute stream and returns
//! before it ran, as NCCL's calls do; its results are ordered on that stream, before every
//! later kernel, copy or collective queued there (so a kernel reading the result needs no
//! wait), and the host sees them once it waits for the stream ([`DevBuf::to_host`],
//! [`Gpu::synchronize`]). A buffer may be dropped right after the call that reads it, as after
//! a kernel: the caching allocator hands its memory only to work queued later on the same
//! stream. A communicator moved to the communication stream ([`NcclComm::set_stream`]) runs
//! beside the kernels instead, and its caller orders it with events (`driver`'s module docs).
//! Every rank must call the same collectives in the same order; a rank that stops
//! leaves the others waiting inside NCCL's kernels ([`NcclComm::async_error`] tells,
//! [`NcclComm::abort`] frees).
//!
//! Point-to-point exchanges are grouped ([`NcclComm::group`]: `ncclGroupStart` / `ncclGroupEnd`),
//! which is how [`NcclComm::all_to_all_v`] is made of sends and receives; a send or receive to
//! the rank itself is only accepted inside a group (outside one it would wait for itself).

use super::driver::{to_i32, DevBuf, DevSlice, DevSliceMut, Gpu, Stream};
use super::sys::{self, ncclComm_t};
use super::CudaError;
use crate::dtype::DType;
use std::cell::Cell;
use std::ffi::{c_void, CStr};
use std::sync::Arc;

/// NCCL's library, or the error naming it.
fn library() -> Result<&'static sys::Nccl, CudaError> {
    sys::nccl().map_err(CudaError::Library)
}

/// The result of an NCCL call as an error naming the call (and NCCL's text for the code).
fn check(lib: &sys::Nccl, r: sys::ncclResult_t, call: &str) -> Result<(), CudaError> {
    if r == sys::NCCL_SUCCESS {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString returns a static NUL-terminated string (or null).
    let p = unsafe { (lib.ncclGetErrorString)(r) };
    let message = if p.is_null() {
        result_name(r).to_string()
    } else {
        // SAFETY: non-null, from NCCL: a NUL-terminated static string.
        let text = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
        format!("{}: {text}", result_name(r))
    };
    Err(CudaError::Nccl {
        call: call.to_string(),
        code: r,
        message,
    })
}

/// The name of an `ncclResult_t` in nccl.h.
fn result_name(r: sys::ncclResult_t) -> &'static str {
    match r {
        sys::NCCL_SUCCESS => "ncclSuccess",
        sys::NCCL_UNHANDLED_CUDA_ERROR => "ncclUnhandledCudaError",
        sys::NCCL_SYSTEM_ERROR => "ncclSystemError",
        sys::NCCL_INTERNAL_ERROR => "ncclInternalError",
        sys::NCCL_INVALID_ARGUMENT => "ncclInvalidArgument",
        sys::NCCL_INVALID_USAGE => "ncclInvalidUsage",
        sys::NCCL_REMOTE_ERROR => "ncclRemoteError",
        sys::NCCL_IN_PROGRESS => "ncclInProgress",
        _ => "unknown ncclResult_t",
    }
}

/// `(major, minor, patch)` of an `ncclGetVersion` code: `X·1000 + Y·100 + Z` up to 2.8,
/// `X·10000 + Y·100 + Z` from 2.9 on (nccl.h's `NCCL_VERSION`).
fn decode_version(code: i32) -> (u32, u32, u32) {
    let c = code.max(0) as u32;
    if c >= 10_000 {
        (c / 10_000, c % 10_000 / 100, c % 100)
    } else {
        (c / 1000, c % 1000 / 100, c % 100)
    }
}

/// The oldest NCCL the collectives accept: bf16 and `ncclAvg` came with 2.10.
pub const MIN_VERSION: (u32, u32, u32) = (2, 10, 0);

/// The version of the NCCL library found (`ncclGetVersion`), e.g. `(2, 21, 5)`; needs no GPU.
pub fn nccl_version() -> Result<(u32, u32, u32), CudaError> {
    let lib = library()?;
    let mut code = 0;
    // SAFETY: a valid out-pointer.
    check(
        lib,
        unsafe { (lib.ncclGetVersion)(&mut code) },
        "ncclGetVersion",
    )?;
    Ok(decode_version(code))
}

/// The file NCCL was opened from (for reports).
pub fn nccl_library_path() -> Result<String, CudaError> {
    Ok(library()?.path.clone())
}

/// NCCL's element type for `dtype`.
fn nccl_type(dtype: DType) -> sys::ncclDataType_t {
    match dtype {
        DType::F32 => sys::NCCL_FLOAT32,
        DType::BF16 => sys::NCCL_BFLOAT16,
        DType::F16 => sys::NCCL_FLOAT16,
    }
}

/// A reduction of the reducing collectives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Prod,
    Max,
    Min,
    /// The sum divided by the number of ranks (NCCL ≥ 2.10).
    Avg,
}

impl ReduceOp {
    /// The `ncclRedOp_t` value.
    pub fn code(self) -> sys::ncclRedOp_t {
        match self {
            ReduceOp::Sum => sys::NCCL_SUM,
            ReduceOp::Prod => sys::NCCL_PROD,
            ReduceOp::Max => sys::NCCL_MAX,
            ReduceOp::Min => sys::NCCL_MIN,
            ReduceOp::Avg => sys::NCCL_AVG,
        }
    }
}

/// The identity of a communicator: `NCCL_UNIQUE_ID_BYTES` (128) opaque bytes that one rank
/// makes ([`NcclId::new`]) and every rank is given ([`NcclId::to_bytes`] /
/// [`NcclId::from_bytes`]: it travels as bytes, e.g. through the rendezvous store).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NcclId([u8; sys::NCCL_UNIQUE_ID_BYTES]);

impl NcclId {
    /// Bytes of an id.
    pub const BYTES: usize = sys::NCCL_UNIQUE_ID_BYTES;

    /// A new id (`ncclGetUniqueId`: NCCL's bootstrap listens on this host for the ranks of the
    /// communicator it names); needs NCCL, not a GPU.
    pub fn new() -> Result<NcclId, CudaError> {
        let lib = library()?;
        let mut id = sys::ncclUniqueId {
            internal: [0; Self::BYTES],
        };
        // SAFETY: a valid out-pointer to a 128-byte ncclUniqueId.
        check(
            lib,
            unsafe { (lib.ncclGetUniqueId)(&mut id) },
            "ncclGetUniqueId",
        )?;
        Ok(NcclId(id.internal))
    }

    /// The id's bytes.
    pub fn as_bytes(&self) -> &[u8; Self::BYTES] {
        &self.0
    }

    /// The id's bytes, owned (what goes into the store).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.to_vec()
    }

    /// The id from its bytes; an error unless there are exactly [`NcclId::BYTES`].
    pub fn from_bytes(bytes: &[u8]) -> Result<NcclId, CudaError> {
        let a: [u8; Self::BYTES] = bytes.try_into().map_err(|_| {
            CudaError::Shape(format!(
                "an NCCL unique id is {} bytes, got {}",
                Self::BYTES,
                bytes.len()
            ))
        })?;
        Ok(NcclId(a))
    }
}

impl TryFrom<&[u8]> for NcclId {
    type Error = CudaError;
    fn try_from(bytes: &[u8]) -> Result<Self, CudaError> {
        NcclId::from_bytes(bytes)
    }
}

impl std::fmt::Debug for NcclId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclId(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

/// A device range a collective reads: address, length, element type and device.
#[derive(Clone, Copy)]
pub struct NcclBuf<'a> {
    ptr: u64,
    len: usize,
    dtype: DType,
    gpu: &'a Arc<Gpu>,
}

/// A device range a collective writes.
pub struct NcclBufMut<'a> {
    ptr: u64,
    len: usize,
    dtype: DType,
    gpu: &'a Arc<Gpu>,
    _w: std::marker::PhantomData<&'a mut ()>,
}

impl<'a> NcclBuf<'a> {
    /// 16-bit storage (`u16` bit patterns) of `dtype` (`BF16` or `F16`; `F32` is an error).
    pub fn half(dtype: DType, s: impl Into<DevSlice<'a, u16>>) -> Result<Self, CudaError> {
        half_only(dtype)?;
        let s: DevSlice<'a, u16> = s.into();
        Ok(NcclBuf {
            ptr: s.ptr(),
            len: s.len(),
            dtype,
            gpu: s.gpu(),
        })
    }

    /// bf16 bit patterns.
    pub fn bf16(s: impl Into<DevSlice<'a, u16>>) -> Self {
        let s: DevSlice<'a, u16> = s.into();
        NcclBuf {
            ptr: s.ptr(),
            len: s.len(),
            dtype: DType::BF16,
            gpu: s.gpu(),
        }
    }

    /// fp16 bit patterns.
    pub fn f16(s: impl Into<DevSlice<'a, u16>>) -> Self {
        NcclBuf {
            dtype: DType::F16,
            ..Self::bf16(s)
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The address of element `i` (`i ≤ len`, checked by the callers).
    fn ptr_at(&self, i: usize) -> *const c_void {
        (self.ptr + (i * self.dtype.size_of()) as u64) as *const c_void
    }
}

impl<'a> NcclBufMut<'a> {
    /// 16-bit storage (`u16` bit patterns) of `dtype` (`BF16` or `F16`; `F32` is an error).
    pub fn half(dtype: DType, s: impl Into<DevSliceMut<'a, u16>>) -> Result<Self, CudaError> {
        half_only(dtype)?;
        let s: DevSliceMut<'a, u16> = s.into();
        Ok(NcclBufMut {
            ptr: s.ptr(),
            len: s.len(),
            dtype,
            gpu: s.gpu(),
            _w: std::marker::PhantomData,
        })
    }

    /// bf16 bit patterns.
    pub fn bf16(s: impl Into<DevSliceMut<'a, u16>>) -> Self {
        let s: DevSliceMut<'a, u16> = s.into();
        NcclBufMut {
            ptr: s.ptr(),
            len: s.len(),
            dtype: DType::BF16,
            gpu: s.gpu(),
            _w: std::marker::PhantomData,
        }
    }

    /// fp16 bit patterns.
    pub fn f16(s: impl Into<DevSliceMut<'a, u16>>) -> Self {
        NcclBufMut {
            dtype: DType::F16,
            ..Self::bf16(s)
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The address of element `i` (`i ≤ len`, checked by the callers).
    fn ptr_at(&self, i: usize) -> *mut c_void {
        (self.ptr + (i * self.dtype.size_of()) as u64) as *mut c_void
    }
}

impl std::fmt::Debug for NcclBuf<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclBuf<{}>[{}] on cuda:{}",
            self.dtype.name(),
            self.len,
            self.gpu.info.ordinal
        )
    }
}

impl std::fmt::Debug for NcclBufMut<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclBufMut<{}>[{}] on cuda:{}",
            self.dtype.name(),
            self.len,
            self.gpu.info.ordinal
        )
    }
}

fn half_only(dtype: DType) -> Result<(), CudaError> {
    if dtype == DType::F32 {
        return Err(CudaError::Shape(
            "16-bit storage tagged F32: u16 bit patterns are BF16 or F16".into(),
        ));
    }
    Ok(())
}

/// `From` conversions of the typed device buffers and slices of one element type.
macro_rules! typed {
    ($t:ty, $dtype:expr) => {
        impl<'a> From<DevSlice<'a, $t>> for NcclBuf<'a> {
            fn from(s: DevSlice<'a, $t>) -> Self {
                NcclBuf {
                    ptr: s.ptr(),
                    len: s.len(),
                    dtype: $dtype,
                    gpu: s.gpu(),
                }
            }
        }
        impl<'a> From<&'a DevBuf<$t>> for NcclBuf<'a> {
            fn from(b: &'a DevBuf<$t>) -> Self {
                NcclBuf::from(b.as_slice())
            }
        }
        impl<'a> From<DevSliceMut<'a, $t>> for NcclBufMut<'a> {
            fn from(s: DevSliceMut<'a, $t>) -> Self {
                NcclBufMut {
                    ptr: s.ptr(),
                    len: s.len(),
                    dtype: $dtype,
                    gpu: s.gpu(),
                    _w: std::marker::PhantomData,
                }
            }
        }
        impl<'a> From<&'a mut DevBuf<$t>> for NcclBufMut<'a> {
            fn from(b: &'a mut DevBuf<$t>) -> Self {
                NcclBufMut::from(b.as_mut_slice())
            }
        }
    };
}

typed!(f32, DType::F32);
typed!(half::bf16, DType::BF16);
typed!(half::f16, DType::F16);

thread_local! {
    /// How deep this thread is inside [`group`] calls.
    static GROUP_DEPTH: Cell<usize> = const { Cell::new(0) };
}

/// Runs `f` between `ncclGroupStart` and `ncclGroupEnd`: the NCCL calls it makes (on any
/// communicators of this thread) are launched together at the end, which is what lets
/// matching sends and receives between ranks (or to the rank itself) proceed. The group is
/// ended even when `f` fails; `f`'s error comes first. Groups nest.
pub fn group<R>(f: impl FnOnce() -> Result<R, CudaError>) -> Result<R, CudaError> {
    let lib = library()?;
    // SAFETY: no arguments; NCCL keeps the group state per thread.
    check(lib, unsafe { (lib.ncclGroupStart)() }, "ncclGroupStart")?;
    /// Counts this thread's group depth while alive (also when `f` unwinds).
    struct Depth;
    impl Drop for Depth {
        fn drop(&mut self) {
            GROUP_DEPTH.with(|d| d.set(d.get().saturating_sub(1)));
        }
    }
    GROUP_DEPTH.with(|d| d.set(d.get() + 1));
    let depth = Depth;
    let out = f();
    drop(depth);
    // SAFETY: ends the group started above.
    let end = check(lib, unsafe { (lib.ncclGroupEnd)() }, "ncclGroupEnd");
    let r = out?;
    end?;
    Ok(r)
}

fn in_group() -> bool {
    GROUP_DEPTH.with(|d| d.get() > 0)
}

/// The element offsets of `counts` (one per rank) in a buffer of `len` elements, checked:
/// `nranks` counts summing to `len`.
fn offsets(
    what: &str,
    counts: &[usize],
    len: usize,
    nranks: usize,
) -> Result<Vec<usize>, CudaError> {
    if counts.len() != nranks {
        return Err(CudaError::Shape(format!(
            "{what}: {} counts for {nranks} ranks",
            counts.len()
        )));
    }
    let mut at = Vec::with_capacity(nranks);
    let mut sum = 0usize;
    for &c in counts {
        at.push(sum);
        sum = sum
            .checked_add(c)
            .ok_or_else(|| CudaError::Shape(format!("{what}: the counts {counts:?} overflow")))?;
    }
    if sum != len {
        return Err(CudaError::Shape(format!(
            "{what}: the counts sum to {sum}, the buffer holds {len} elements"
        )));
    }
    Ok(at)
}

/// `rank < nranks`, or an error naming the call and the role (`root`, `peer`).
fn check_rank(call: &str, role: &str, rank: usize, nranks: usize) -> Result<(), CudaError> {
    if rank < nranks {
        Ok(())
    } else {
        Err(CudaError::Shape(format!(
            "{call}: {role} {rank} of a communicator of {nranks} rank(s)"
        )))
    }
}

/// `a == b` elements, or an error naming the call and what was expected.
fn check_len(call: &str, what: &str, got: usize, want: usize) -> Result<(), CudaError> {
    if got == want {
        Ok(())
    } else {
        Err(CudaError::Shape(format!(
            "{call}: {what} holds {got} elements, {want} expected"
        )))
    }
}

/// An NCCL communicator: this process's rank among `size` ranks, on one [`Gpu`].
///
/// A communicator is used by one thread at a time (it is `Send`, not `Sync`: NCCL does not
/// allow concurrent calls on one communicator); dropping it destroys it (`ncclCommDestroy`,
/// which lets queued collectives finish), [`NcclComm::abort`] gives it up at once.
pub struct NcclComm {
    lib: &'static sys::Nccl,
    comm: ncclComm_t,
    gpu: Arc<Gpu>,
    rank: usize,
    size: usize,
    /// The stream its collectives are queued on ([`NcclComm::set_stream`]).
    stream: Stream,
}

// SAFETY: an NCCL communicator may move between threads; the raw handle keeps it `!Sync`.
unsafe impl Send for NcclComm {}

impl NcclComm {
    /// Rank `rank` of the `nranks`-rank communicator `id` names, on `gpu` (whose context is
    /// made current on this thread first: NCCL takes the device from it). Blocks until every
    /// rank joined, so each rank calls it from its own thread or process.
    pub fn init(
        gpu: &Arc<Gpu>,
        id: &NcclId,
        nranks: usize,
        rank: usize,
    ) -> Result<NcclComm, CudaError> {
        if nranks == 0 {
            return Err(CudaError::Shape(
                "ncclCommInitRank: a communicator of 0 ranks".into(),
            ));
        }
        check_rank("ncclCommInitRank", "rank", rank, nranks)?;
        let (n, r) = (to_i32(nranks, "nranks")?, to_i32(rank, "rank")?);
        let lib = library()?;
        let version = nccl_version()?;
        if version < MIN_VERSION {
            return Err(CudaError::Library(format!(
                "NCCL {}.{}.{} ({}) is older than {}.{}: xtrain's collectives need bf16 and \
                 ncclAvg (install a newer NCCL, e.g. the pip wheel nvidia-nccl-cu12)",
                version.0, version.1, version.2, lib.path, MIN_VERSION.0, MIN_VERSION.1
            )));
        }
        gpu.bind()?;
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the id is passed by value as nccl.h declares.
        check(
            lib,
            unsafe {
                (lib.ncclCommInitRank)(&mut comm, n, sys::ncclUniqueId { internal: id.0 }, r)
            },
            "ncclCommInitRank",
        )?;
        Ok(NcclComm {
            lib,
            comm,
            gpu: gpu.clone(),
            rank,
            size: nranks,
            stream: Stream::Compute,
        })
    }

    /// Queues the collectives from now on on stream `s` of the GPU (the compute stream
    /// unless set): on [`Stream::Comm`] the caller orders them against the compute stream
    /// with events ([`Gpu::record`], [`Gpu::wait_for`]) and keeps their buffers alive until
    /// the compute stream has waited for them (the module docs of `driver`).
    pub fn set_stream(&mut self, s: Stream) {
        self.stream = s;
    }

    /// The stream the collectives are queued on.
    pub fn stream(&self) -> Stream {
        self.stream
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// The number of ranks.
    pub fn size(&self) -> usize {
        self.size
    }

    /// The GPU the communicator runs on (whose stream its collectives are queued on).
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// An error NCCL met in the background (`ncclCommGetAsyncError`), e.g. a peer that
    /// failed: then the communicator must be aborted.
    pub fn async_error(&self) -> Result<(), CudaError> {
        let mut r = sys::NCCL_SUCCESS;
        // SAFETY: a live communicator and a valid out-pointer.
        check(
            self.lib,
            unsafe { (self.lib.ncclCommGetAsyncError)(self.comm, &mut r) },
            "ncclCommGetAsyncError",
        )?;
        check(self.lib, r, "the communicator (asynchronous error)")
    }

    /// Gives the communicator up at once (`ncclCommAbort`): what a rank does when a peer
    /// failed, instead of waiting for it in a collective; queued collectives are cancelled.
    pub fn abort(mut self) -> Result<(), CudaError> {
        let comm = std::mem::replace(&mut self.comm, std::ptr::null_mut());
        // NCCL selects the device itself; the context is made current where it can be, and
        // the abort goes ahead regardless (a failing context is a reason to abort).
        let _ = self.gpu.bind();
        // SAFETY: the live communicator, given up here (the drop sees null and does nothing).
        check(
            self.lib,
            unsafe { (self.lib.ncclCommAbort)(comm) },
            "ncclCommAbort",
        )
    }

    /// Checks that `buf` lives on this communicator's GPU.
    fn same_gpu(&self, call: &str, gpu: &Arc<Gpu>) -> Result<(), CudaError> {
        if Arc::ptr_eq(gpu, &self.gpu) {
            Ok(())
        } else {
            Err(CudaError::Shape(format!(
                "{call}: a buffer on cuda:{}, the communicator on cuda:{}",
                gpu.info.ordinal, self.gpu.info.ordinal
            )))
        }
    }

    /// The checks every call with a send and a receive range makes: both on this GPU, one
    /// element type.
    fn pair(&self, call: &str, send: &NcclBuf<'_>, recv: &NcclBufMut<'_>) -> Result<(), CudaError> {
        self.same_gpu(call, send.gpu)?;
        self.same_gpu(call, recv.gpu)?;
        if send.dtype != recv.dtype {
            return Err(CudaError::Shape(format!(
                "{call}: sends {} and receives {}",
                send.dtype.name(),
                recv.dtype.name()
            )));
        }
        Ok(())
    }

    /// `recv = op over the ranks of send` on every rank (`ncclAllReduce`), queued on the
    /// stream. `send` and `recv` have one length.
    pub fn all_reduce<'s, 'r>(
        &self,
        send: impl Into<NcclBuf<'s>>,
        recv: impl Into<NcclBufMut<'r>>,
        op: ReduceOp,
    ) -> Result<(), CudaError> {
        let (send, recv) = (send.into(), recv.into());
        const CALL: &str = "ncclAllReduce";
        self.pair(CALL, &send, &recv)?;
        check_len(CALL, "recv", recv.len, send.len)?;
        self.all_reduce_raw(send.ptr_at(0), recv.ptr_at(0), recv.len, recv.dtype, op)
    }

    /// [`NcclComm::all_reduce`] in place: `buf = op over the ranks of buf`.
    pub fn all_reduce_in_place<'b>(
        &self,
        buf: impl Into<NcclBufMut<'b>>,
        op: ReduceOp,
    ) -> Result<(), CudaError> {
        let buf = buf.into();
        self.same_gpu("ncclAllReduce", buf.gpu)?;
        self.all_reduce_raw(buf.ptr_at(0), buf.ptr_at(0), buf.len, buf.dtype, op)
    }

    fn all_reduce_raw(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<(), CudaError> {
        if count == 0 {
            return Ok(()); // every rank has the same count: nothing to do anywhere
        }
        self.gpu.bind()?;
        let stream = self.gpu.stream_of(self.stream)?;
        // SAFETY: both ranges hold `count` elements of `dtype` on this communicator's GPU
        // (checked by the callers); NCCL accepts send == recv (in place).
        check(
            self.lib,
            unsafe {
                (self.lib.ncclAllReduce)(
                    send,
                    recv,
                    count,
                    nccl_type(dtype),
                    op.code(),
                    self.comm,
                    stream,
                )
            },
            "ncclAllReduce",
        )
    }

    /// `recv = op over the ranks of send` on rank `root` only (`ncclReduce`); `recv` has the
    /// length of `send` on every rank, and NCCL writes it on `root` only.
    pub fn reduce<'s, 'r>(
        &self,
        send: impl Into<NcclBuf<'s>>,
        recv: impl Into<NcclBufMut<'r>>,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CudaError> {
        let (send, recv) = (send.into(), recv.into());
        const CALL: &str = "ncclReduce";
        self.pair(CALL, &send, &recv)?;
        check_len(CALL, "recv", recv.len, send.len)?;
        check_rank(CALL, "root", root, self.size)?;
        self.reduce_raw(
            send.ptr_at(0),
            recv.ptr_at(0),
            send.len,
            send.dtype,
            op,
            root,
        )
    }

    /// [`NcclComm::reduce`] in place: on `root`, `buf = op over the ranks of buf`; the
    /// other ranks' `buf` is only read.
    pub fn reduce_in_place<'b>(
        &self,
        buf: impl Into<NcclBufMut<'b>>,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CudaError> {
        let buf = buf.into();
        const CALL: &str = "ncclReduce";
        self.same_gpu(CALL, buf.gpu)?;
        check_rank(CALL, "root", root, self.size)?;
        self.reduce_raw(buf.ptr_at(0), buf.ptr_at(0), buf.len, buf.dtype, op, root)
    }

    fn reduce_raw(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        root: usize,
    ) -> Result<(), CudaError> {
        if count == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let stream = self.gpu.stream_of(self.stream)?;
        // SAFETY: both ranges hold `count` elements of `dtype` on this GPU (checked by the
        // callers); NCCL accepts send == recv (in place).
        check(
            self.lib,
            unsafe {
                (self.lib.ncclReduce)(
                    send,
                    recv,
                    count,
                    nccl_type(dtype),
                    op.code(),
                    root as i32,
                    self.comm,
                    stream,
                )
            },
            "ncclReduce",
        )
    }

    /// `buf` of rank `root` copied into `buf` of every rank (`ncclBroadcast`, in place).
    pub fn broadcast<'b>(
        &self,
        buf: impl Into<NcclBufMut<'b>>,
        root: usize,
    ) -> Result<(), CudaError> {
        let buf = buf.into();
        const CALL: &str = "ncclBroadcast";
        self.same_gpu(CALL, buf.gpu)?;
        check_rank(CALL, "root", root, self.size)?;
        self.broadcast_raw(buf.ptr_at(0), buf.len, buf.dtype, root)
    }

    fn broadcast_raw(
        &self,
        ptr: *mut c_void,
        count: usize,
        dtype: DType,
        root: usize,
    ) -> Result<(), CudaError> {
        if count == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let stream = self.gpu.stream_of(self.stream)?;
        // SAFETY: the range holds `count` elements of `dtype` on this GPU (checked by the
        // callers); in place (send == recv).
        check(
            self.lib,
            unsafe {
                (self.lib.ncclBroadcast)(
                    ptr,
                    ptr,
                    count,
                    nccl_type(dtype),
                    root as i32,
                    self.comm,
                    stream,
                )
            },
            "ncclBroadcast",
        )
    }

    /// All-gather with a count per rank, in place: `buf` holds rank 0's block, then rank 1's,
    /// … (`counts[p]` elements from rank `p`, summing to its length), this rank's block
    /// filled on entry; afterwards (stream order) every block holds its owner's values.
    /// One broadcast from each rank with a block, grouped (NCCL's all-gather needs equal
    /// counts; ZeRO's shards of a unit are not).
    pub fn all_gather_v_in_place<'b>(
        &self,
        buf: impl Into<NcclBufMut<'b>>,
        counts: &[usize],
    ) -> Result<(), CudaError> {
        let buf = buf.into();
        self.same_gpu("all_gather_v_in_place", buf.gpu)?;
        let at = offsets("all_gather_v_in_place", counts, buf.len, self.size)?;
        self.group(|| {
            for p in 0..self.size {
                self.broadcast_raw(buf.ptr_at(at[p]), counts[p], buf.dtype, p)?;
            }
            Ok(())
        })
    }

    /// `ranks × n` elements (the long side of a gather or scatter), or an error on overflow.
    fn ranks_times(&self, call: &str, n: usize) -> Result<usize, CudaError> {
        n.checked_mul(self.size).ok_or_else(|| {
            CudaError::Shape(format!("{call}: {n} × {} elements overflow", self.size))
        })
    }

    /// `recv = [send of rank 0, send of rank 1, …]` on every rank (`ncclAllGather`):
    /// `recv.len() == size × send.len()`.
    pub fn all_gather<'s, 'r>(
        &self,
        send: impl Into<NcclBuf<'s>>,
        recv: impl Into<NcclBufMut<'r>>,
    ) -> Result<(), CudaError> {
        let (send, recv) = (send.into(), recv.into());
        const CALL: &str = "ncclAllGather";
        self.pair(CALL, &send, &recv)?;
        let want = self.ranks_times(CALL, send.len)?;
        check_len(CALL, "recv (ranks × send)", recv.len, want)?;
        if send.len == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let stream = self.gpu.stream_of(self.stream)?;
        // SAFETY: `send` holds `send.len` and `recv` `size × send.len` elements (checked).
        check(
            self.lib,
            unsafe {
                (self.lib.ncclAllGather)(
                    send.ptr_at(0),
                    recv.ptr_at(0),
                    send.len,
                    nccl_type(send.dtype),
                    self.comm,
                    stream,
                )
            },
            CALL,
        )
    }

    /// `recv = block `rank` of (op over the ranks of send)` (`ncclReduceScatter`):
    /// `send.len() == size × recv.len()`, block `r` being `send[r·n .. (r+1)·n]`.
    pub fn reduce_scatter<'s, 'r>(
        &self,
        send: impl Into<NcclBuf<'s>>,
        recv: impl Into<NcclBufMut<'r>>,
        op: ReduceOp,
    ) -> Result<(), CudaError> {
        let (send, recv) = (send.into(), recv.into());
        const CALL: &str = "ncclReduceScatter";
        self.pair(CALL, &send, &recv)?;
        let want = self.ranks_times(CALL, recv.len)?;
        check_len(CALL, "send (ranks × recv)", send.len, want)?;
        if recv.len == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let stream = self.gpu.stream_of(self.stream)?;
        // SAFETY: `send` holds `size × recv.len` and `recv` `recv.len` elements (checked).
        check(
            self.lib,
            unsafe {
                (self.lib.ncclReduceScatter)(
                    send.ptr_at(0),
                    recv.ptr_at(0),
                    recv.len,
                    nccl_type(send.dtype),
                    op.code(),
                    self.comm,
                    stream,
                )
            },
            CALL,
        )
    }

    /// Sends `buf` to rank `peer` (`ncclSend`), which receives it with [`NcclComm::recv`] of
    /// the same length and type. Exchanges between ranks go in a [`NcclComm::group`] (two
    /// ranks sending to each other first would wait for each other); to the rank itself, a
    /// group is required.
    pub fn send<'b>(&self, buf: impl Into<NcclBuf<'b>>, peer: usize) -> Result<(), CudaError> {
        let buf = buf.into();
        self.same_gpu("ncclSend", buf.gpu)?;
        self.p2p_checks("ncclSend", peer)?;
        self.send_raw(buf.ptr_at(0), buf.len, buf.dtype, peer)
    }

    /// Receives into `buf` from rank `peer` (`ncclRecv`); see [`NcclComm::send`].
    pub fn recv<'b>(&self, buf: impl Into<NcclBufMut<'b>>, peer: usize) -> Result<(), CudaError> {
        let buf = buf.into();
        self.same_gpu("ncclRecv", buf.gpu)?;
        self.p2p_checks("ncclRecv", peer)?;
        self.recv_raw(buf.ptr_at(0), buf.len, buf.dtype, peer)
    }

    fn p2p_checks(&self, call: &str, peer: usize) -> Result<(), CudaError> {
        check_rank(call, "peer", peer, self.size)?;
        if peer == self.rank && !in_group() {
            return Err(CudaError::Shape(format!(
                "{call} to rank {peer} itself outside a group (it would wait for itself): \
                 put the send and the receive in NcclComm::group"
            )));
        }
        Ok(())
    }

    fn send_raw(
        &self,
        ptr: *const c_void,
        count: usize,
        dtype: DType,
        peer: usize,
    ) -> Result<(), CudaError> {
        if count == 0 {
            return Ok(()); // the matching receive is empty too, and skipped the same way
        }
        self.gpu.bind()?;
        let stream = self.gpu.stream_of(self.stream)?;
        // SAFETY: `ptr` holds `count` elements of `dtype` on this GPU (checked by the callers).
        check(
            self.lib,
            unsafe {
                (self.lib.ncclSend)(ptr, count, nccl_type(dtype), peer as i32, self.comm, stream)
            },
            "ncclSend",
        )
    }

    fn recv_raw(
        &self,
        ptr: *mut c_void,
        count: usize,
        dtype: DType,
        peer: usize,
    ) -> Result<(), CudaError> {
        if count == 0 {
            return Ok(());
        }
        self.gpu.bind()?;
        let stream = self.gpu.stream_of(self.stream)?;
        // SAFETY: `ptr` holds `count` elements of `dtype` on this GPU (checked by the callers).
        check(
            self.lib,
            unsafe {
                (self.lib.ncclRecv)(ptr, count, nccl_type(dtype), peer as i32, self.comm, stream)
            },
            "ncclRecv",
        )
    }

    /// [`group`] with this communicator's context current: `f`'s NCCL calls are launched
    /// together when it returns (matching sends and receives, all-to-all exchanges).
    pub fn group<R>(&self, f: impl FnOnce() -> Result<R, CudaError>) -> Result<R, CudaError> {
        self.gpu.bind()?;
        group(f)
    }

    /// All-to-all with counts per rank, as grouped sends and receives: `send` holds the blocks
    /// for ranks 0, 1, … one after the other (`send_counts[p]` elements for rank `p`), `recv`
    /// receives the blocks from ranks 0, 1, … (`recv_counts[p]` from rank `p`). Each count
    /// list has one entry per rank and sums to its buffer's length; `recv_counts[p]` here
    /// must equal `send_counts[rank]` on rank `p`.
    pub fn all_to_all_v<'s, 'r>(
        &self,
        send: impl Into<NcclBuf<'s>>,
        send_counts: &[usize],
        recv: impl Into<NcclBufMut<'r>>,
        recv_counts: &[usize],
    ) -> Result<(), CudaError> {
        let (send, recv) = (send.into(), recv.into());
        const CALL: &str = "all_to_all_v";
        self.pair(CALL, &send, &recv)?;
        let send_at = offsets("all_to_all_v send", send_counts, send.len, self.size)?;
        let recv_at = offsets("all_to_all_v recv", recv_counts, recv.len, self.size)?;
        self.group(|| {
            for p in 0..self.size {
                self.send_raw(send.ptr_at(send_at[p]), send_counts[p], send.dtype, p)?;
                self.recv_raw(recv.ptr_at(recv_at[p]), recv_counts[p], recv.dtype, p)?;
            }
            Ok(())
        })
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.comm.is_null() {
            return; // aborted
        }
        if self.gpu.bind().is_ok() {
            // SAFETY: the live communicator, destroyed once (nothing uses it after the drop).
            unsafe {
                (self.lib.ncclCommDestroy)(self.comm);
            }
        }
    }
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclComm(rank {} of {} on cuda:{})",
            self.rank, self.size, self.gpu.info.ordinal
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn id_bytes_round_trip() {
        let bytes: Vec<u8> = (0..NcclId::BYTES).map(|i| (i * 37 + 11) as u8).collect();
        let id = NcclId::from_bytes(&bytes).unwrap();
        assert_eq!(id.to_bytes(), bytes);
        assert_eq!(&id.as_bytes()[..], &bytes[..]);
        let again = NcclId::try_from(&id.to_bytes()[..]).unwrap();
        assert_eq!(again, id);
        // The id crosses into the C struct unchanged.
        let c = sys::ncclUniqueId { internal: id.0 };
        assert_eq!(&c.internal[..], &bytes[..]);
        assert_eq!(std::mem::size_of::<sys::ncclUniqueId>(), 128);
    }

    #[test]
    fn id_of_the_wrong_length_is_an_error() {
        for n in [0, 1, 127, 129, 256] {
            match NcclId::from_bytes(&vec![7u8; n]) {
                Err(CudaError::Shape(m)) => {
                    assert!(m.contains("128") && m.contains(&n.to_string()), "{m}")
                }
                other => panic!("{n} bytes: {other:?}"),
            }
        }
    }

    #[test]
    fn versions_decode_both_schemes() {
        assert_eq!(decode_version(2708), (2, 7, 8));
        assert_eq!(decode_version(2804), (2, 8, 4));
        assert_eq!(decode_version(21803), (2, 18, 3));
        assert_eq!(decode_version(22707), (2, 27, 7));
        assert!(decode_version(21003) >= MIN_VERSION);
        assert!(decode_version(2804) < MIN_VERSION);
    }

    #[test]
    fn codes_are_those_of_nccl_h() {
        assert_eq!(nccl_type(DType::F32), 7);
        assert_eq!(nccl_type(DType::F16), 6);
        assert_eq!(nccl_type(DType::BF16), 9);
        let ops = [
            (ReduceOp::Sum, 0),
            (ReduceOp::Prod, 1),
            (ReduceOp::Max, 2),
            (ReduceOp::Min, 3),
            (ReduceOp::Avg, 4),
        ];
        for (op, code) in ops {
            assert_eq!(op.code(), code, "{op:?}");
        }
        assert_eq!(result_name(4), "ncclInvalidArgument");
        assert_eq!(result_name(99), "unknown ncclResult_t");
    }

    #[test]
    fn count_lists_are_checked() {
        assert_eq!(offsets("t", &[3, 0, 2], 5, 3).unwrap(), vec![0, 3, 3]);
        assert_eq!(offsets("t", &[], 0, 0).unwrap(), Vec::<usize>::new());
        let bad = [
            offsets("t", &[3, 2], 5, 3),             // too few counts
            offsets("t", &[3, 0, 2], 6, 3),          // wrong sum
            offsets("t", &[usize::MAX, 1, 0], 0, 3), // overflow
        ];
        for b in bad {
            assert!(matches!(b, Err(CudaError::Shape(_))), "{b:?}");
        }
        assert!(check_rank("c", "root", 2, 2).is_err());
        assert!(check_rank("c", "root", 1, 2).is_ok());
        assert!(check_len("c", "recv", 3, 4).is_err());
        assert!(half_only(DType::F32).is_err());
        assert!(half_only(DType::BF16).is_ok());
    }
}
