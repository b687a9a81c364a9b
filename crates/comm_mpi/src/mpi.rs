//! The MPI backend: a group's operations run as the system MPI library's collectives (Open MPI
//! through the `mpi` crate) instead of xtrain's own engine, behind the same
//! [`comm::ProcessGroup`] API ([`comm::external`]: this module implements its
//! [`ExternalWorld`] and [`ExternalGroup`] on type-erased buffers, whose arguments `comm` has
//! checked), so every parallelism runs on it unchanged.
//!
//! - The world is `MPI_COMM_WORLD` (ranks from `mpirun`); a group is
//!   `MPI_Comm_create_group` over its members in the given order, collective over them only.
//! - MPI is initialised with `MPI_THREAD_MULTIPLE`, because each group's asynchronous work runs
//!   on its own worker thread (as with the own engine), so several groups call MPI at once.
//! - Element types travel as their MPI equivalents; bf16 and f16 travel as 16-bit words and
//!   are reduced by user-defined operations that combine in f32 and round once per
//!   combination, like the own engine. `Avg` comes here as a sum (`comm` divides).
//! - Errors are returned (`MPI_ERRORS_RETURN`), not fatal. MPI has no timeouts: a peer that
//!   dies is handled by `mpirun`, which stops the job.
//! - [`finalize`] ends MPI at the end of a successful run; groups still alive then leave their
//!   communicators to the library instead of freeing them after the end.
use std::ffi::{c_int, c_void};
use std::sync::{Arc, Mutex, OnceLock};

use comm::external::{ExternalGroup, ExternalLibrary, ExternalWorld, OpCounter};
use comm::{CommError, DType, Element, OpKind, ReduceOp, Result};
use mpi::ffi;
use mpi::topology::{Communicator as _, Group as _, SimpleCommunicator};
use mpi::traits::AsRaw;

/// The entry points `comm` calls.
pub fn library() -> ExternalLibrary {
    ExternalLibrary {
        init: || Ok(Arc::new(World::init()?) as Arc<dyn ExternalWorld>),
        finalize,
        version: library_version,
    }
}

/// A caller's mistake, as `comm`'s error for it.
fn invalid(op: &str, detail: impl Into<String>) -> CommError {
    CommError::InvalidArgument {
        op: op.into(),
        detail: detail.into(),
    }
}

/// The MPI environment, alive from the first [`World::init`] to [`finalize`].
static UNIVERSE: Mutex<Option<mpi::environment::Universe>> = Mutex::new(None);

/// Ends MPI (`MPI_Finalize`) if this process started it; a no-op otherwise. Call it once, at
/// the end of a successful run: a rank that failed must exit without it (its peers may be
/// blocked in a collective, and `mpirun` stops the job when a rank exits with an error).
fn finalize() {
    let universe = UNIVERSE.lock().unwrap_or_else(|e| e.into_inner()).take();
    drop(universe);
}

fn finalized() -> bool {
    let mut flag: c_int = 0;
    // SAFETY: MPI_Finalized may be called at any time, even before MPI_Init.
    unsafe { ffi::MPI_Finalized(&mut flag) };
    flag != 0
}

/// The MPI library's message for an error code.
fn error_string(code: c_int) -> String {
    let mut buf = vec![0u8; 512];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING (256 in Open MPI) bytes and more.
    unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr().cast(), &mut len) };
    buf.truncate(len.max(0) as usize);
    String::from_utf8_lossy(&buf).into_owned()
}

/// `Ok` for `MPI_SUCCESS` (0), else an error naming the call and MPI's message.
fn check(code: c_int, group: &str, call: &str) -> Result<()> {
    if code == 0 {
        return Ok(());
    }
    Err(CommError::Refused(format!(
        "group {group}: {call} failed: {}",
        error_string(code)
    )))
}

/// Elements of `dt` in `bytes` bytes.
fn elems(bytes: usize, dt: DType) -> usize {
    bytes / dt.size()
}

/// An MPI count (`int`) for `n` elements, or an error past MPI's limit.
fn count(n: usize, call: &str) -> Result<c_int> {
    c_int::try_from(n).map_err(|_| {
        invalid(
            call,
            format!("{n} elements exceed MPI's count limit of {}", c_int::MAX),
        )
    })
}

fn counts(ns: &[usize], call: &str) -> Result<Vec<c_int>> {
    ns.iter().map(|&n| count(n, call)).collect()
}

/// Prefix sums of `counts` (displacements), checked against the count limit.
fn displacements(counts: &[c_int], call: &str) -> Result<Vec<c_int>> {
    let mut d = Vec::with_capacity(counts.len());
    let mut at = 0usize;
    for &c in counts {
        d.push(count(at, call)?);
        at += c as usize;
    }
    Ok(d)
}

/// Where an element buffer starts, for MPI. An empty slice's pointer is a dangling, aligned
/// address such as 1, which Open MPI takes for `MPI_IN_PLACE`; empty buffers point at a real
/// word instead (MPI reads and writes nothing there for a count of 0).
fn in_ptr<T>(buf: &[T]) -> *const c_void {
    static EMPTY: u64 = 0;
    if buf.is_empty() {
        (&EMPTY as *const u64).cast()
    } else {
        buf.as_ptr().cast()
    }
}

fn out_ptr<T>(buf: &mut [T]) -> *mut c_void {
    in_ptr(buf).cast_mut()
}

/// MPI datatype of an element type (half types as 16-bit words).
fn datatype(d: DType) -> ffi::MPI_Datatype {
    // SAFETY: reading the library's predefined datatype handles after MPI_Init.
    unsafe {
        match d {
            DType::F32 => ffi::RSMPI_FLOAT,
            DType::BF16 | DType::F16 => ffi::RSMPI_UINT16_T,
            DType::I32 => ffi::RSMPI_INT32_T,
            DType::I64 => ffi::RSMPI_INT64_T,
            DType::U8 => ffi::RSMPI_UINT8_T,
        }
    }
}

/// MPI's handles are plain pointers; the library is initialised for use from any thread.
#[derive(Clone, Copy)]
struct OpHandle(ffi::MPI_Op);
// SAFETY: an MPI_Op handle is immutable after creation and valid on every thread under
// MPI_THREAD_MULTIPLE.
unsafe impl Send for OpHandle {}
unsafe impl Sync for OpHandle {}

/// `inout[i] = op(in[i], inout[i])` over `len` elements of `T` (an MPI user function).
unsafe extern "C" fn reduce_elements<T: Element, const OP: u8>(
    input: *mut c_void,
    inout: *mut c_void,
    len: *mut c_int,
    _dt: *mut ffi::MPI_Datatype,
) {
    let n = *len as usize;
    if n == 0 {
        return;
    }
    // SAFETY: MPI passes two buffers of `len` elements of the datatype the op was used with,
    // which is T's 16-bit word for the half types this function is registered for.
    let a = std::slice::from_raw_parts(input as *const T, n);
    let b = std::slice::from_raw_parts_mut(inout as *mut T, n);
    for (b, &a) in b.iter_mut().zip(a) {
        *b = match OP {
            1 => T::add(a, *b),
            3 => T::max(a, *b),
            _ => T::min(a, *b),
        };
    }
}

/// The MPI operation reducing elements of type `dt` by `op` (`Avg` sums).
fn operation(dt: DType, op: ReduceOp) -> ffi::MPI_Op {
    let k = match op {
        ReduceOp::Sum | ReduceOp::Avg => 0,
        ReduceOp::Max => 1,
        ReduceOp::Min => 2,
    };
    if !matches!(dt, DType::BF16 | DType::F16) {
        // SAFETY: predefined operation handles, valid after MPI_Init.
        return unsafe { [ffi::RSMPI_SUM, ffi::RSMPI_MAX, ffi::RSMPI_MIN][k] };
    }
    // User operations for the half types, created once: [bf16, f16] × [sum, max, min].
    static HALF_OPS: OnceLock<[[OpHandle; 3]; 2]> = OnceLock::new();
    let ops = HALF_OPS.get_or_init(|| {
        fn create(f: ffi::MPI_User_function) -> OpHandle {
            let mut op: ffi::MPI_Op = unsafe { ffi::RSMPI_SUM };
            // SAFETY: registers a commutative user function; `op` receives the new handle.
            unsafe { ffi::MPI_Op_create(f, 1, &mut op) };
            OpHandle(op)
        }
        use half::{bf16, f16};
        [
            [
                create(Some(reduce_elements::<bf16, 1>)),
                create(Some(reduce_elements::<bf16, 3>)),
                create(Some(reduce_elements::<bf16, 4>)),
            ],
            [
                create(Some(reduce_elements::<f16, 1>)),
                create(Some(reduce_elements::<f16, 3>)),
                create(Some(reduce_elements::<f16, 4>)),
            ],
        ]
    });
    ops[usize::from(dt == DType::F16)][k].0
}

/// This process's place in `MPI_COMM_WORLD`.
struct World {
    world: SimpleCommunicator,
}

// SAFETY: MPI_COMM_WORLD's handle is a constant, and MPI runs at MPI_THREAD_MULTIPLE, so
// any thread may use it (group creation calls are collective and made in the same order).
unsafe impl Send for World {}
unsafe impl Sync for World {}

impl World {
    /// Initialises MPI with `MPI_THREAD_MULTIPLE` (once per process).
    fn init() -> Result<World> {
        let mut universe = UNIVERSE.lock().unwrap_or_else(|e| e.into_inner());
        if universe.is_none() {
            if finalized() {
                return Err(invalid("MPI", "MPI was already finalized in this process"));
            }
            let (u, provided) = mpi::initialize_with_threading(mpi::Threading::Multiple)
                .ok_or_else(|| invalid("MPI", "MPI was initialised outside xtrain"))?;
            if provided != mpi::Threading::Multiple {
                return Err(invalid(
                    "MPI",
                    format!(
                        "the MPI library provides thread level {provided:?}, xtrain needs \
                         Multiple (each group's asynchronous work runs on its own thread)"
                    ),
                ));
            }
            // SAFETY: sets the error handler of MPI_COMM_WORLD (inherited by every group).
            unsafe {
                ffi::MPI_Comm_set_errhandler(ffi::RSMPI_COMM_WORLD, ffi::RSMPI_ERRORS_RETURN)
            };
            *universe = Some(u);
        }
        Ok(World {
            world: SimpleCommunicator::world(),
        })
    }
}

impl ExternalWorld for World {
    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn size(&self) -> usize {
        self.world.size() as usize
    }

    fn all_hosts(&self, host: &str) -> Result<Vec<String>> {
        const W: usize = 256;
        let mut mine = [0u8; W];
        let b = host.as_bytes();
        mine[..b.len().min(W)].copy_from_slice(&b[..b.len().min(W)]);
        let mut all = vec![0u8; W * self.size()];
        // SAFETY: buffers of W and size × W bytes, as described to MPI.
        let rc = unsafe {
            ffi::MPI_Allgather(
                in_ptr(&mine),
                W as c_int,
                ffi::RSMPI_UINT8_T,
                out_ptr(&mut all),
                W as c_int,
                ffi::RSMPI_UINT8_T,
                self.world.as_raw(),
            )
        };
        check(rc, "world", "MPI_Allgather")?;
        Ok(all
            .chunks(W)
            .map(|c| {
                let end = c.iter().position(|&x| x == 0).unwrap_or(W);
                String::from_utf8_lossy(&c[..end]).into_owned()
            })
            .collect())
    }

    /// `MPI_Comm_create_group` over `members`.
    fn create(
        &self,
        members: &[usize],
        rank: usize,
        tag: i32,
        name: &str,
        counter: OpCounter,
    ) -> Result<Box<dyn ExternalGroup>> {
        let ranks: Vec<i32> = members.iter().map(|&r| r as i32).collect();
        let group = self.world.group().include(&ranks);
        let comm = self
            .world
            .split_by_subgroup_with_tag(&group, tag)
            .ok_or_else(|| CommError::Refused(format!("{name}: MPI_Comm_create_group failed")))?;
        let raw = comm.as_raw();
        Ok(Box::new(MpiGroup {
            comm: Some(comm),
            raw,
            name: name.to_string(),
            size: members.len(),
            rank,
            counter,
            poisoned: None,
        }))
    }
}

/// One group's MPI communicator.
struct MpiGroup {
    comm: Option<SimpleCommunicator>,
    raw: ffi::MPI_Comm,
    name: String,
    size: usize,
    rank: usize,
    counter: OpCounter,
    poisoned: Option<String>,
}

// SAFETY: the library runs at MPI_THREAD_MULTIPLE, so the communicator may be used from the
// group's worker thread; the group's mutex keeps one call at a time on it.
unsafe impl Send for MpiGroup {}

impl Drop for MpiGroup {
    fn drop(&mut self) {
        if let Some(c) = self.comm.take() {
            if finalized() {
                // Freeing after MPI_Finalize is an error; the library has let go of it.
                std::mem::forget(c);
            }
        }
    }
}

impl MpiGroup {
    /// Counts one operation of `kind` sending `bytes`, after checking the group is usable.
    fn begin(&self, kind: OpKind, bytes: usize) -> Result<()> {
        if let Some(first) = &self.poisoned {
            return Err(CommError::Poisoned {
                group: self.name.clone(),
                first: first.clone(),
            });
        }
        self.counter.count(kind, bytes);
        Ok(())
    }

    /// Checks an MPI return code; a failure poisons the group like a broken link does.
    fn check(&mut self, code: c_int, call: &str) -> Result<()> {
        let r = check(code, &self.name, call);
        if let Err(e) = &r {
            self.poisoned.get_or_insert_with(|| e.to_string());
        }
        r
    }

    fn check_peer(&self, call: &str, p: usize) -> Result<c_int> {
        if p >= self.size || p == self.rank {
            return Err(invalid(
                call,
                format!(
                    "peer {p} is not another rank of group {} (size {})",
                    self.name, self.size
                ),
            ));
        }
        Ok(p as c_int)
    }
}

impl ExternalGroup for MpiGroup {
    fn size(&self) -> usize {
        self.size
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn name(&self) -> &str {
        &self.name
    }

    fn abort(&mut self, reason: String) {
        self.poisoned.get_or_insert(reason);
    }

    fn p2p(
        &mut self,
        dtype: DType,
        sends: &[(usize, &[u8])],
        recvs: &mut [(usize, &mut [u8])],
        tag: u32,
    ) -> Result<()> {
        let call = "p2p";
        let bytes = sends.iter().map(|s| s.1.len()).sum();
        self.begin(OpKind::P2p, bytes)?;
        let tag = c_int::try_from(tag)
            .map_err(|_| invalid(call, format!("tag {tag} exceeds MPI's tag range")))?;
        let dt = datatype(dtype);
        let mut reqs: Vec<ffi::MPI_Request> = Vec::with_capacity(sends.len() + recvs.len());
        let mut rc = 0;
        for (p, b) in recvs.iter_mut() {
            let (p, n) = (
                self.check_peer(call, *p)?,
                count(elems(b.len(), dtype), call)?,
            );
            // SAFETY: a null request slot MPI fills; `b` stays borrowed until Waitall below.
            let mut r = unsafe { ffi::RSMPI_REQUEST_NULL };
            rc = rc.max(unsafe { ffi::MPI_Irecv(out_ptr(b), n, dt, p, tag, self.raw, &mut r) });
            reqs.push(r);
        }
        for (p, b) in sends {
            let (p, n) = (
                self.check_peer(call, *p)?,
                count(elems(b.len(), dtype), call)?,
            );
            // SAFETY: as above; `sends` outlives Waitall.
            let mut r = unsafe { ffi::RSMPI_REQUEST_NULL };
            rc = rc.max(unsafe { ffi::MPI_Isend(in_ptr(b), n, dt, p, tag, self.raw, &mut r) });
            reqs.push(r);
        }
        // SAFETY: zeroed statuses are plain data MPI overwrites.
        let mut statuses: Vec<ffi::MPI_Status> = vec![unsafe { std::mem::zeroed() }; reqs.len()];
        let wait = unsafe {
            ffi::MPI_Waitall(
                reqs.len() as c_int,
                reqs.as_mut_ptr(),
                statuses.as_mut_ptr(),
            )
        };
        self.check(rc, "MPI_Isend/MPI_Irecv")?;
        self.check(wait, "MPI_Waitall")?;
        for ((p, b), st) in recvs.iter().zip(&statuses) {
            let mut got: c_int = 0;
            // SAFETY: a status MPI_Waitall filled in.
            unsafe { ffi::MPI_Get_count(st, dt, &mut got) };
            let want = elems(b.len(), dtype);
            if got as usize != want {
                return Err(invalid(
                    call,
                    format!(
                        "group {}: rank {p} sent {got} elements, {want} expected",
                        self.name
                    ),
                ));
            }
        }
        Ok(())
    }

    fn all_reduce(&mut self, dtype: DType, buf: &mut [u8], op: ReduceOp) -> Result<()> {
        self.begin(OpKind::AllReduce, buf.len())?;
        if buf.is_empty() {
            // Every rank passes the same length; MPI would see two equal (dangling) pointers.
            return Ok(());
        }
        let input = buf.to_vec();
        let n = count(elems(buf.len(), dtype), "all_reduce")?;
        // SAFETY: two buffers of n elements of the datatype.
        let rc = unsafe {
            ffi::MPI_Allreduce(
                in_ptr(&input),
                out_ptr(buf),
                n,
                datatype(dtype),
                operation(dtype, op),
                self.raw,
            )
        };
        self.check(rc, "MPI_Allreduce")
    }

    fn reduce(&mut self, dtype: DType, buf: &mut [u8], op: ReduceOp, root: usize) -> Result<()> {
        self.begin(OpKind::Reduce, buf.len())?;
        if buf.is_empty() {
            return Ok(());
        }
        let input = buf.to_vec();
        let n = count(elems(buf.len(), dtype), "reduce")?;
        let out: *mut c_void = if self.rank == root {
            out_ptr(buf)
        } else {
            std::ptr::null_mut()
        };
        // SAFETY: n elements in, n out on the root (ignored elsewhere).
        let rc = unsafe {
            ffi::MPI_Reduce(
                in_ptr(&input),
                out,
                n,
                datatype(dtype),
                operation(dtype, op),
                root as c_int,
                self.raw,
            )
        };
        self.check(rc, "MPI_Reduce")
    }

    fn broadcast(&mut self, dtype: DType, buf: &mut [u8], root: usize) -> Result<()> {
        let sent = if self.rank == root { buf.len() } else { 0 };
        self.begin(OpKind::Broadcast, sent)?;
        let n = count(elems(buf.len(), dtype), "broadcast")?;
        // SAFETY: n elements of the datatype.
        let rc =
            unsafe { ffi::MPI_Bcast(out_ptr(buf), n, datatype(dtype), root as c_int, self.raw) };
        self.check(rc, "MPI_Bcast")
    }

    fn reduce_scatter(
        &mut self,
        dtype: DType,
        input: &[u8],
        output: &mut [u8],
        op: ReduceOp,
    ) -> Result<()> {
        let n = self.size;
        let len = elems(input.len(), dtype);
        let shards: Vec<usize> = (0..n).map(|i| comm::shard_range(len, n, i).len()).collect();
        self.begin(OpKind::ReduceScatter, input.len())?;
        if input.is_empty() {
            return Ok(());
        }
        let recvcounts = counts(&shards, "reduce_scatter")?;
        // SAFETY: the input holds the sum of recvcounts elements; the output its own shard.
        let rc = unsafe {
            ffi::MPI_Reduce_scatter(
                in_ptr(input),
                out_ptr(output),
                recvcounts.as_ptr(),
                datatype(dtype),
                operation(dtype, op),
                self.raw,
            )
        };
        self.check(rc, "MPI_Reduce_scatter")
    }

    fn all_gather(&mut self, dtype: DType, input: &[u8], output: &mut [u8]) -> Result<()> {
        self.begin(OpKind::AllGather, input.len())?;
        let (c, dt) = (
            count(elems(input.len(), dtype), "all_gather")?,
            datatype(dtype),
        );
        // SAFETY: m elements in, n × m out.
        let rc =
            unsafe { ffi::MPI_Allgather(in_ptr(input), c, dt, out_ptr(output), c, dt, self.raw) };
        self.check(rc, "MPI_Allgather")
    }

    fn all_gather_v(&mut self, dtype: DType, input: &[u8]) -> Result<(Vec<u8>, Vec<usize>)> {
        let n = self.size;
        self.begin(OpKind::AllGatherV, input.len())?;
        let mine = count(elems(input.len(), dtype), "all_gather_v")?;
        let mut lens: Vec<c_int> = vec![0; n];
        // SAFETY: one int in, n out.
        let rc = unsafe {
            ffi::MPI_Allgather(
                (&mine as *const c_int).cast(),
                1,
                ffi::RSMPI_INT32_T,
                out_ptr(&mut lens),
                1,
                ffi::RSMPI_INT32_T,
                self.raw,
            )
        };
        self.check(rc, "MPI_Allgather")?;
        let displs = displacements(&lens, "all_gather_v")?;
        let lens: Vec<usize> = lens.iter().map(|&c| c as usize).collect();
        let mut out = vec![0u8; lens.iter().sum::<usize>() * dtype.size()];
        let counts_c = counts(&lens, "all_gather_v")?;
        let dt = datatype(dtype);
        // SAFETY: out holds the sum of the counts; displacements are their prefix sums.
        let rc = unsafe {
            ffi::MPI_Allgatherv(
                in_ptr(input),
                mine,
                dt,
                out_ptr(&mut out),
                counts_c.as_ptr(),
                displs.as_ptr(),
                dt,
                self.raw,
            )
        };
        self.check(rc, "MPI_Allgatherv")?;
        Ok((out, lens))
    }

    fn gather(
        &mut self,
        dtype: DType,
        input: &[u8],
        output: Option<&mut [u8]>,
        root: usize,
    ) -> Result<()> {
        let out: *mut c_void = match output {
            Some(o) if self.rank == root => out_ptr(o),
            _ => std::ptr::null_mut(),
        };
        self.begin(OpKind::Gather, input.len())?;
        let (c, dt) = (count(elems(input.len(), dtype), "gather")?, datatype(dtype));
        // SAFETY: m elements in; n × m out on the root (checked by comm).
        let rc =
            unsafe { ffi::MPI_Gather(in_ptr(input), c, dt, out, c, dt, root as c_int, self.raw) };
        self.check(rc, "MPI_Gather")
    }

    fn scatter(
        &mut self,
        dtype: DType,
        input: Option<&[u8]>,
        output: &mut [u8],
        root: usize,
    ) -> Result<()> {
        let (inp, sent): (*const c_void, usize) = match input {
            Some(i) if self.rank == root => (in_ptr(i), i.len()),
            _ => (std::ptr::null(), 0),
        };
        self.begin(OpKind::Scatter, sent)?;
        let (c, dt) = (
            count(elems(output.len(), dtype), "scatter")?,
            datatype(dtype),
        );
        // SAFETY: n × m elements in on the root (checked by comm); m out.
        let rc = unsafe {
            ffi::MPI_Scatter(inp, c, dt, out_ptr(output), c, dt, root as c_int, self.raw)
        };
        self.check(rc, "MPI_Scatter")
    }

    fn all_to_all(&mut self, dtype: DType, input: &[u8], output: &mut [u8]) -> Result<()> {
        let n = self.size;
        self.begin(OpKind::AllToAll, input.len())?;
        let (c, dt) = (
            count(elems(input.len(), dtype) / n, "all_to_all")?,
            datatype(dtype),
        );
        // SAFETY: n blocks of c elements in and out.
        let rc =
            unsafe { ffi::MPI_Alltoall(in_ptr(input), c, dt, out_ptr(output), c, dt, self.raw) };
        self.check(rc, "MPI_Alltoall")
    }

    fn all_to_all_v(
        &mut self,
        dtype: DType,
        input: &[u8],
        send_counts: &[usize],
    ) -> Result<(Vec<u8>, Vec<usize>)> {
        let n = self.size;
        self.begin(OpKind::AllToAllV, input.len())?;
        let sc = counts(send_counts, "all_to_all_v")?;
        let mut rc_counts: Vec<c_int> = vec![0; n];
        // SAFETY: one int to and from each rank.
        let rc = unsafe {
            ffi::MPI_Alltoall(
                in_ptr(&sc),
                1,
                ffi::RSMPI_INT32_T,
                out_ptr(&mut rc_counts),
                1,
                ffi::RSMPI_INT32_T,
                self.raw,
            )
        };
        self.check(rc, "MPI_Alltoall")?;
        let (sd, rd) = (
            displacements(&sc, "all_to_all_v")?,
            displacements(&rc_counts, "all_to_all_v")?,
        );
        let recv_counts: Vec<usize> = rc_counts.iter().map(|&c| c as usize).collect();
        let mut out = vec![0u8; recv_counts.iter().sum::<usize>() * dtype.size()];
        let dt = datatype(dtype);
        // SAFETY: counts and displacements describe `input` and `out` exactly.
        let rc = unsafe {
            ffi::MPI_Alltoallv(
                in_ptr(input),
                sc.as_ptr(),
                sd.as_ptr(),
                dt,
                out_ptr(&mut out),
                rc_counts.as_ptr(),
                rd.as_ptr(),
                dt,
                self.raw,
            )
        };
        self.check(rc, "MPI_Alltoallv")?;
        Ok((out, recv_counts))
    }

    fn barrier(&mut self) -> Result<()> {
        self.begin(OpKind::Barrier, 0)?;
        // SAFETY: a barrier on this group's communicator.
        let rc = unsafe { ffi::MPI_Barrier(self.raw) };
        self.check(rc, "MPI_Barrier")
    }
}

/// The MPI library's version line (e.g. `Open MPI v4.1.4, ...`).
fn library_version() -> String {
    mpi::environment::library_version()
        .unwrap_or_default()
        .lines()
        .next()
        .unwrap_or("")
        .to_string()
}
