//! [`ProcessGroup`]: the public handle to a group's collectives, synchronous and asynchronous.
//!
//! Every operation runs on the group's [`Backend`] (the own engine, or MPI). Synchronous calls run on the caller's thread
//! (after any earlier asynchronous work, so submission order is kept); asynchronous calls
//! (`*_async`, `isend`, `irecv`) go to a per-group background worker that executes them in
//! submission order, like an NCCL stream, and return a [`Work`] handle. Asynchronous calls take
//! and return owned buffers, so nothing is borrowed across threads.
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex};

use crate::backend::Backend;
use crate::collectives::AllReduceAlgo;
use crate::compress::Codec;
use crate::element::{Element, ReduceOp};
use crate::engine::{Counters, Engine, GroupDesc};
use crate::error::{CommError, Result};
use crate::wire::OpKind;

type Job = Box<dyn FnOnce(&mut Backend) + Send>;

/// Completion slot shared by a [`Work`] and the worker.
struct Slot<R> {
    value: Mutex<Option<Result<R>>>,
    done: Condvar,
}

/// Handle to an asynchronous operation.
#[must_use = "an asynchronous operation's errors only surface through wait()"]
pub struct Work<R> {
    slot: Arc<Slot<R>>,
}

impl<R> Work<R> {
    /// Blocks until the operation finished and returns its result (the buffers it was given,
    /// now holding the output). Operations have their own timeouts, so this returns.
    pub fn wait(self) -> Result<R> {
        let mut v = self.slot.value.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(r) = v.take() {
                return r;
            }
            v = self.slot.done.wait(v).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Whether the operation finished (`wait` will then not block).
    pub fn is_completed(&self) -> bool {
        self.slot
            .value
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
    }
}

/// Counts of operations issued and payload bytes sent, per operation kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CommStats {
    ops: [u64; 12],
    bytes: [u64; 12],
}

impl CommStats {
    /// Operations of `kind` issued on this rank.
    pub fn ops(&self, kind: OpKind) -> u64 {
        self.ops[kind.index()]
    }
    /// Payload bytes this rank sent for operations of `kind` (headers excluded).
    pub fn bytes_sent(&self, kind: OpKind) -> u64 {
        self.bytes[kind.index()]
    }
    pub fn total_ops(&self) -> u64 {
        self.ops.iter().sum()
    }
    pub fn total_bytes_sent(&self) -> u64 {
        self.bytes.iter().sum()
    }
}

struct Shared {
    desc: Arc<GroupDesc>,
    engine: Arc<Mutex<Backend>>,
    counters: Arc<Counters>,
    default_algo: AllReduceAlgo,
    /// Threshold of single-copy ring steps, when the group uses them.
    single_copy: Option<usize>,
    /// Background worker (started on first async call) and the count of jobs not yet done.
    worker: Mutex<Option<mpsc::Sender<Job>>>,
    outstanding: Arc<(Mutex<usize>, Condvar)>,
}

/// A sub-communicator over a list of world ranks (the world itself is one too). Cheap to clone;
/// clones share the connections. Ranks passed to its methods are ranks *within the group*.
#[derive(Clone)]
pub struct ProcessGroup {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for ProcessGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "ProcessGroup({}, rank {})",
            self.shared.desc.name, self.shared.desc.rank
        )
    }
}

impl ProcessGroup {
    pub(crate) fn new(engine: Engine, default_algo: AllReduceAlgo) -> Self {
        let desc = Arc::clone(&engine.desc);
        let counters = Arc::clone(&engine.counters);
        let single_copy = engine.single_copy;
        Self::with_backend(
            Backend::Own(engine),
            desc,
            counters,
            single_copy,
            default_algo,
        )
    }

    /// A group whose operations run on `backend`.
    pub(crate) fn with_backend(
        backend: Backend,
        desc: Arc<GroupDesc>,
        counters: Arc<Counters>,
        single_copy: Option<usize>,
        default_algo: AllReduceAlgo,
    ) -> Self {
        ProcessGroup {
            shared: Arc::new(Shared {
                desc,
                engine: Arc::new(Mutex::new(backend)),
                counters,
                default_algo,
                single_copy,
                worker: Mutex::new(None),
                outstanding: Arc::new((Mutex::new(0), Condvar::new())),
            }),
        }
    }

    /// This rank's index in the group.
    pub fn rank(&self) -> usize {
        self.shared.desc.rank
    }

    /// Number of ranks in the group.
    pub fn size(&self) -> usize {
        self.shared.desc.world_ranks.len()
    }

    /// World rank of each group rank.
    pub fn world_ranks(&self) -> &[usize] {
        &self.shared.desc.world_ranks
    }

    /// Name used in errors, e.g. `dp[0,2,4,6]`.
    pub fn name(&self) -> &str {
        &self.shared.desc.name
    }

    /// `Some(min bytes)` when ring collectives of at least that size read same-host peers'
    /// buffers directly (single copy), `None` when this group always uses its links' rings.
    pub fn single_copy_min_bytes(&self) -> Option<usize> {
        self.shared.single_copy
    }

    /// Snapshot of this rank's counters for this group.
    pub fn stats(&self) -> CommStats {
        let c = &self.shared.counters;
        let mut s = CommStats::default();
        for i in 0..12 {
            s.ops[i] = c.ops[i].load(Ordering::Relaxed);
            s.bytes[i] = c.bytes[i].load(Ordering::Relaxed);
        }
        s
    }

    /// Resets the counters to zero.
    pub fn reset_stats(&self) {
        for i in 0..12 {
            self.shared.counters.ops[i].store(0, Ordering::Relaxed);
            self.shared.counters.bytes[i].store(0, Ordering::Relaxed);
        }
    }

    /// Runs `f` on the backend on this thread, after all earlier asynchronous work.
    fn run<R>(&self, f: impl FnOnce(&mut Backend) -> Result<R>) -> Result<R> {
        let (lock, cv) = &*self.shared.outstanding;
        let mut n = lock.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            n = cv.wait(n).unwrap_or_else(|e| e.into_inner());
        }
        drop(n);
        let mut engine = self.shared.engine.lock().unwrap_or_else(|e| e.into_inner());
        let r = f(&mut engine);
        engine.end_op(r.is_ok());
        r
    }

    /// Queues `f` on the group's worker; the result arrives in the returned [`Work`].
    fn submit<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Backend) -> Result<R> + Send + 'static,
    ) -> Work<R> {
        let slot = Arc::new(Slot {
            value: Mutex::new(None),
            done: Condvar::new(),
        });
        let out = Arc::clone(&slot);
        let outstanding = Arc::clone(&self.shared.outstanding);
        let job: Job = Box::new(move |engine| {
            // A panic must not leave the handle (and every later synchronous call) waiting.
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(engine)))
                .unwrap_or_else(|p| {
                    let msg = p
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    engine.abort(format!("asynchronous operation panicked: {msg}"));
                    Err(CommError::Panicked(msg))
                });
            engine.end_op(r.is_ok());
            *out.value.lock().unwrap_or_else(|e| e.into_inner()) = Some(r);
            out.done.notify_all();
            let (lock, cv) = &*outstanding;
            *lock.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
            cv.notify_all();
        });
        *self
            .shared
            .outstanding
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner()) += 1;
        let mut worker = self.shared.worker.lock().unwrap_or_else(|e| e.into_inner());
        let tx = worker.get_or_insert_with(|| {
            let (tx, rx) = mpsc::channel::<Job>();
            let engine = Arc::clone(&self.shared.engine);
            let name = format!("comm-{}", self.shared.desc.name);
            std::thread::Builder::new()
                .name(name)
                .spawn(move || {
                    for job in rx {
                        let mut e = engine.lock().unwrap_or_else(|e| e.into_inner());
                        job(&mut e);
                    }
                })
                .expect("spawning the communication worker thread");
            tx
        });
        if let Err(mpsc::SendError(job)) = tx.send(job) {
            // Worker gone (cannot normally happen): run inline so the Work still completes.
            let mut e = self.shared.engine.lock().unwrap_or_else(|e| e.into_inner());
            job(&mut e);
        }
        Work { slot }
    }

    // ------------------------------------------------------------ point-to-point

    /// Sends `buf` to group rank `dst`; returns once it is handed to the transport.
    pub fn send<T: Element>(&self, buf: &[T], dst: usize, tag: u32) -> Result<()> {
        self.run(|e| e.p2p(&[(dst, buf)], &mut [], tag))
    }

    /// Receives exactly `buf.len()` elements from group rank `src` (length and type checked).
    pub fn recv<T: Element>(&self, buf: &mut [T], src: usize, tag: u32) -> Result<()> {
        self.run(|e| e.p2p::<T>(&[], &mut [(src, buf)], tag))
    }

    /// Sends and receives all at once: the deadlock-free form for exchanges such as ring shifts.
    pub fn send_recv<T: Element>(
        &self,
        sends: &[(usize, &[T])],
        recvs: &mut [(usize, &mut [T])],
        tag: u32,
    ) -> Result<()> {
        self.run(|e| e.p2p(sends, recvs, tag))
    }

    /// Asynchronous send of any owned buffer of `T`s (a `Vec`, or page-locked memory a GPU's
    /// copy engine wrote); the handle gives the buffer back.
    pub fn isend<T: Element, B: AsRef<[T]> + Send + 'static>(
        &self,
        buf: B,
        dst: usize,
        tag: u32,
    ) -> Work<B> {
        self.submit(move |e| e.p2p(&[(dst, buf.as_ref())], &mut [], tag).map(|_| buf))
    }

    /// Asynchronous receive into any owned buffer (its length is the expected length).
    pub fn irecv<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
        src: usize,
        tag: u32,
    ) -> Work<B> {
        self.submit(move |e| {
            e.p2p::<T>(&[], &mut [(src, buf.as_mut())], tag)
                .map(|_| buf)
        })
    }

    /// Asynchronous batched exchange of owned buffers; returns the receive buffers, filled,
    /// in order.
    pub fn send_recv_async<T, S, R>(
        &self,
        sends: Vec<(usize, S)>,
        recvs: Vec<(usize, R)>,
        tag: u32,
    ) -> Work<Vec<R>>
    where
        T: Element,
        S: AsRef<[T]> + Send + 'static,
        R: AsMut<[T]> + Send + 'static,
    {
        self.submit(move |e| {
            let s: Vec<(usize, &[T])> = sends.iter().map(|(p, b)| (*p, b.as_ref())).collect();
            let mut recvs = recvs;
            let mut r: Vec<(usize, &mut [T])> =
                recvs.iter_mut().map(|(p, b)| (*p, b.as_mut())).collect();
            e.p2p(&s, &mut r, tag)?;
            Ok(recvs.into_iter().map(|(_, b)| b).collect())
        })
    }

    // ------------------------------------------------------------ collectives

    /// In-place all-reduce with the group's default algorithm.
    pub fn all_reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce_with(buf, op, self.shared.default_algo)
    }

    /// In-place all-reduce with an explicit algorithm.
    pub fn all_reduce_with<T: Element>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
        algo: AllReduceAlgo,
    ) -> Result<()> {
        self.run(|e| e.all_reduce(buf, op, algo))
    }

    /// In-place all-reduce on the group's worker thread; `buf` is any owned buffer of `T`s
    /// (a `Vec`, or page-locked memory a GPU's copy engine reads and writes), handed back
    /// by the [`Work`].
    pub fn all_reduce_async<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
        op: ReduceOp,
    ) -> Work<B> {
        let algo = self.shared.default_algo;
        self.submit(move |e| e.all_reduce(buf.as_mut(), op, algo).map(|_| buf))
    }

    pub fn all_reduce_with_async<T: Element>(
        &self,
        mut buf: Vec<T>,
        op: ReduceOp,
        algo: AllReduceAlgo,
    ) -> Work<Vec<T>> {
        self.submit(move |e| e.all_reduce(&mut buf, op, algo).map(|_| buf))
    }

    /// Sums `buf` over the group with the values on the wire in `codec`, summed in fp32
    /// ([`crate::compress::all_reduce`]); the same result on every rank.
    pub fn all_reduce_compressed(&self, buf: &mut [f32], codec: Codec) -> Result<()> {
        let (name, n, me) = (self.name().to_string(), self.size(), self.rank());
        self.run(|e| {
            crate::compress::all_reduce(
                e,
                buf,
                codec,
                crate::compress::On {
                    group: &name,
                    n,
                    me,
                },
            )
        })
    }

    /// [`ProcessGroup::all_reduce_compressed`] on the group's worker thread, on any owned
    /// buffer (as [`ProcessGroup::all_reduce_async`]).
    pub fn all_reduce_compressed_async<B: AsMut<[f32]> + Send + 'static>(
        &self,
        mut buf: B,
        codec: Codec,
    ) -> Work<B> {
        let (name, n, me) = (self.name().to_string(), self.size(), self.rank());
        self.submit(move |e| {
            let on = crate::compress::On {
                group: &name,
                n,
                me,
            };
            crate::compress::all_reduce(e, buf.as_mut(), codec, on).map(|_| buf)
        })
    }

    /// Sums `buf` over the group onto `root` with the values on the wire in `codec`
    /// ([`crate::compress::reduce`]); other ranks' buffers are left unchanged.
    pub fn reduce_compressed_async<B: AsMut<[f32]> + Send + 'static>(
        &self,
        mut buf: B,
        codec: Codec,
        root: usize,
    ) -> Work<B> {
        let (name, n, me) = (self.name().to_string(), self.size(), self.rank());
        self.submit(move |e| {
            let on = crate::compress::On {
                group: &name,
                n,
                me,
            };
            crate::compress::reduce(e, buf.as_mut(), codec, root, on).map(|_| buf)
        })
    }

    /// Reduces into `buf` on `root`; other ranks' buffers are left unchanged.
    pub fn reduce<T: Element>(&self, buf: &mut [T], op: ReduceOp, root: usize) -> Result<()> {
        self.run(|e| e.reduce(buf, op, root))
    }

    /// [`ProcessGroup::reduce`] on the group's worker thread, on any owned buffer (as
    /// [`ProcessGroup::all_reduce_async`]).
    pub fn reduce_async<T: Element, B: AsMut<[T]> + Send + 'static>(
        &self,
        mut buf: B,
        op: ReduceOp,
        root: usize,
    ) -> Work<B> {
        self.submit(move |e| e.reduce(buf.as_mut(), op, root).map(|_| buf))
    }

    /// Copies `buf` from `root` to every rank.
    pub fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<()> {
        self.run(|e| e.broadcast(buf, root))
    }

    pub fn broadcast_async<T: Element>(&self, mut buf: Vec<T>, root: usize) -> Work<Vec<T>> {
        self.submit(move |e| e.broadcast(&mut buf, root).map(|_| buf))
    }

    /// Reduces `input` across ranks and leaves this rank's shard
    /// ([`shard_range`](crate::shard_range)`(input.len(), size, rank)`) in `output`.
    pub fn reduce_scatter<T: Element>(
        &self,
        input: &[T],
        output: &mut [T],
        op: ReduceOp,
    ) -> Result<()> {
        self.run(|e| e.reduce_scatter(input, output, op))
    }

    /// Asynchronous reduce-scatter; returns this rank's shard.
    pub fn reduce_scatter_async<T: Element>(&self, input: Vec<T>, op: ReduceOp) -> Work<Vec<T>> {
        let (n, r) = (self.size(), self.rank());
        self.submit(move |e| {
            let mut out = vec![T::zeroed(); crate::shard_range(input.len(), n, r).len()];
            e.reduce_scatter(&input, &mut out, op).map(|_| out)
        })
    }

    /// `output` (size × input.len()) receives every rank's `input` in rank order.
    pub fn all_gather<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.run(|e| e.all_gather(input, output))
    }

    pub fn all_gather_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        let n = self.size();
        self.submit(move |e| {
            let mut out = vec![T::zeroed(); n * input.len()];
            e.all_gather(&input, &mut out).map(|_| out)
        })
    }

    /// All-gather of inputs of different lengths: (concatenation in rank order, lengths).
    pub fn all_gather_v<T: Element>(&self, input: &[T]) -> Result<(Vec<T>, Vec<usize>)> {
        self.run(|e| e.all_gather_v(input))
    }

    pub fn all_gather_v_async<T: Element>(&self, input: Vec<T>) -> Work<(Vec<T>, Vec<usize>)> {
        self.submit(move |e| e.all_gather_v(&input))
    }

    /// [`ProcessGroup::all_gather_v`] into `output`, whose length the caller knows (the sum
    /// of the ranks' lengths: an error otherwise); both any owned buffers of `T`s (`Vec`s, or
    /// page-locked memory a GPU's copy engine reads and writes). Gives back the input, the
    /// filled output and the ranks' lengths.
    pub fn all_gather_v_into_async<T, I, O>(
        &self,
        input: I,
        mut output: O,
    ) -> Work<(I, O, Vec<usize>)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.submit(move |e| {
            let counts = e.all_gather_v_into(input.as_ref(), output.as_mut())?;
            Ok((input, output, counts))
        })
    }

    /// `root` receives every rank's `input` (equal lengths) into `output` (size × len).
    pub fn gather<T: Element>(
        &self,
        input: &[T],
        output: Option<&mut [T]>,
        root: usize,
    ) -> Result<()> {
        self.run(|e| e.gather(input, output, root))
    }

    /// Asynchronous gather; `Some(all inputs)` on the root, `None` elsewhere.
    pub fn gather_async<T: Element>(&self, input: Vec<T>, root: usize) -> Work<Option<Vec<T>>> {
        let (n, r) = (self.size(), self.rank());
        self.submit(move |e| {
            if r == root {
                let mut out = vec![T::zeroed(); n * input.len()];
                e.gather(&input, Some(&mut out), root).map(|_| Some(out))
            } else {
                e.gather(&input, None, root).map(|_| None)
            }
        })
    }

    /// Rank i receives block i of `root`'s `input` (size × output.len()) into `output`.
    pub fn scatter<T: Element>(
        &self,
        input: Option<&[T]>,
        output: &mut [T],
        root: usize,
    ) -> Result<()> {
        self.run(|e| e.scatter(input, output, root))
    }

    pub fn scatter_async<T: Element>(
        &self,
        input: Option<Vec<T>>,
        mut output: Vec<T>,
        root: usize,
    ) -> Work<Vec<T>> {
        self.submit(move |e| {
            e.scatter(input.as_deref(), &mut output, root)
                .map(|_| output)
        })
    }

    /// Block i of `input` goes to rank i; block j of `output` comes from rank j.
    pub fn all_to_all<T: Element>(&self, input: &[T], output: &mut [T]) -> Result<()> {
        self.run(|e| e.all_to_all(input, output))
    }

    pub fn all_to_all_async<T: Element>(&self, input: Vec<T>) -> Work<Vec<T>> {
        self.submit(move |e| {
            let mut out = vec![T::zeroed(); input.len()];
            e.all_to_all(&input, &mut out).map(|_| out)
        })
    }

    /// Uneven all-to-all: `send_counts[i]` elements go to rank i; returns (received data in
    /// rank order, per-rank received counts).
    pub fn all_to_all_v<T: Element>(
        &self,
        input: &[T],
        send_counts: &[usize],
    ) -> Result<(Vec<T>, Vec<usize>)> {
        self.run(|e| e.all_to_all_v(input, send_counts))
    }

    pub fn all_to_all_v_async<T: Element>(
        &self,
        input: Vec<T>,
        send_counts: Vec<usize>,
    ) -> Work<(Vec<T>, Vec<usize>)> {
        self.submit(move |e| e.all_to_all_v(&input, &send_counts))
    }

    /// [`ProcessGroup::all_to_all_v`] into `output`, whose length the caller knows (the sum
    /// of what the ranks send here: an error otherwise); both any owned buffers of `T`s (as
    /// [`ProcessGroup::all_gather_v_into_async`]). Gives back the input, the filled output
    /// and the per-rank received counts.
    pub fn all_to_all_v_into_async<T, I, O>(
        &self,
        input: I,
        send_counts: Vec<usize>,
        mut output: O,
    ) -> Work<(I, O, Vec<usize>)>
    where
        T: Element,
        I: AsRef<[T]> + Send + 'static,
        O: AsMut<[T]> + Send + 'static,
    {
        self.submit(move |e| {
            let counts = e.all_to_all_v_into(input.as_ref(), &send_counts, output.as_mut())?;
            Ok((input, output, counts))
        })
    }

    /// Returns once every rank of the group has entered the barrier.
    pub fn barrier(&self) -> Result<()> {
        self.run(|e| e.barrier())
    }

    pub fn barrier_async(&self) -> Work<()> {
        self.submit(|e| e.barrier())
    }

    /// Closes the group's connections: peers waiting on this rank fail at once.
    pub fn abort(&self, reason: &str) {
        let mut e = self.shared.engine.lock().unwrap_or_else(|e| e.into_inner());
        e.abort(reason.to_string());
    }

    #[cfg(test)]
    pub(crate) fn with_engine<R>(&self, f: impl FnOnce(&mut Engine) -> R) -> R {
        match &mut *self.shared.engine.lock().unwrap() {
            Backend::Own(e) => f(e),
            Backend::External(_) => panic!("not the own engine"),
        }
    }
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Dropping the sender ends the worker after queued jobs; the engine (and with it the
        // links) is freed by whichever of us lets go last.
        self.worker.lock().unwrap_or_else(|e| e.into_inner()).take();
    }
}
