//! Page-locked ("pinned") host memory: [`Pinned`], host buffers the GPU's copy engine reads
//! and writes directly.
//!
//! A copy between a GPU and ordinary (pageable) host memory goes through the driver's own
//! pinned staging buffers, a chunk at a time, at a fraction of the link's bandwidth; into or out
//! of page-locked memory it is one DMA transfer at the link's speed (CUDA C Programming Guide,
//! "Page-Locked Host Memory"). Page-locked memory is a scarce resource of the host (it cannot
//! be swapped), so xtrain keeps it for the buffers that carry the bulk of a step's host
//! traffic: ZeRO-Offload's gradient and weight chunks, held across steps
//! (`parallel::executor::offload`), and a pool of scratch buffers lent for each staged
//! collective or message where ranks share a GPU ([`HostScratch`]).
//!
//! Downloads into a [`Pinned`] buffer go through the usual calls (`DevSlice::read_into` on
//! its slice); they wait for the stream as every download does. An upload from it
//! (`DevSliceMut::copy_from_host` on its slice) also returns only once the copy is done: from
//! pageable memory the driver has taken its copy of the data when the call returns, but from
//! page-locked memory the DMA reads the buffer later, and the caller would otherwise overwrite
//! data still on its way. A registry of the live buffers (`is_pinned`) is how the upload knows.
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

use super::driver::{check, Gpu};
use super::CudaError;

/// The address ranges `[start, end)` of the live [`Pinned`] buffers of this process.
static LIVE: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// Whether any byte of `bytes` bytes at `p` lies in a live [`Pinned`] buffer.
pub(crate) fn is_pinned(p: *const c_void, bytes: usize) -> bool {
    let (s, e) = (p as usize, p as usize + bytes);
    LIVE.lock()
        .unwrap_or_else(|x| x.into_inner())
        .iter()
        .any(|&(a, b)| s < b && a < e)
}

/// `len` elements of `T` in page-locked host memory (`cuMemAllocHost`), zeroed; a slice of
/// `T` through `Deref`. Freed on drop, after the GPU's queued work (a copy may still read it).
pub struct Pinned<T: Copy> {
    ptr: *mut T,
    len: usize,
    gpu: Arc<Gpu>,
}

// SAFETY: plain host memory owned by this value; the driver's handles used in `drop` may be
// used from any thread once the context is current there.
unsafe impl<T: Copy + Send> Send for Pinned<T> {}
unsafe impl<T: Copy + Sync> Sync for Pinned<T> {}

/// `bytes` (> 0) zeroed bytes of page-locked memory for copies with `gpu`, registered as live
/// ([`is_pinned`]); given back with [`free_host`].
fn alloc_host(gpu: &Gpu, bytes: usize) -> Result<*mut c_void, CudaError> {
    gpu.bind()?;
    let mut p: *mut c_void = std::ptr::null_mut();
    // SAFETY: a valid out-pointer; the memory is freed by `free_host`.
    check(
        unsafe { (gpu.lib.cuMemAllocHost_v2)(&mut p, bytes) },
        &format!(
            "cuMemAllocHost({bytes} bytes of page-locked host memory: the host's locked \
             memory may be exhausted or limited, see `ulimit -l`)"
        ),
    )?;
    // SAFETY: `p` points to `bytes` writable bytes, aligned for any type (the driver's
    // allocations are page-aligned).
    unsafe { std::ptr::write_bytes(p as *mut u8, 0, bytes) };
    LIVE.lock()
        .unwrap_or_else(|x| x.into_inner())
        .push((p as usize, p as usize + bytes));
    Ok(p)
}

/// Gives back memory of [`alloc_host`], after `gpu`'s queued work (a copy may still use it).
pub(crate) fn free_host(gpu: &Gpu, p: *mut c_void) {
    LIVE.lock()
        .unwrap_or_else(|x| x.into_inner())
        .retain(|&(a, _)| a != p as usize);
    // A download into it may still be queued (its caller waits for it, but may have failed
    // before); a failed context copies nothing more.
    let _ = gpu.synchronize();
    if gpu.bind().is_ok() {
        // SAFETY: memory from cuMemAllocHost, no longer referenced.
        unsafe { (gpu.lib.cuMemFreeHost)(p) };
    }
}

impl Gpu {
    /// `len` zeroed elements of page-locked host memory for copies with this GPU. `T` must be
    /// a plain number type (all-zero bytes a valid value), as for [`Gpu::zeros`].
    pub fn pinned<T: Copy>(self: &Arc<Self>, len: usize) -> Result<Pinned<T>, CudaError> {
        let bytes = len * std::mem::size_of::<T>();
        let ptr = if bytes == 0 {
            std::ptr::NonNull::dangling().as_ptr()
        } else {
            alloc_host(self, bytes)? as *mut T
        };
        Ok(Pinned {
            ptr,
            len,
            gpu: self.clone(),
        })
    }

    /// `len` elements of page-locked scratch lent from this GPU's pool (the smallest free
    /// buffer that holds them, or a new one of the next power of two bytes, at least 256 KiB),
    /// given back when the lease drops. `T` is a plain number type (any bit pattern a valid
    /// value); the contents are what the last lease left.
    pub fn host_scratch<T: Copy>(
        self: &Arc<Self>,
        len: usize,
    ) -> Result<HostScratch<T>, CudaError> {
        let bytes = len * std::mem::size_of::<T>();
        if bytes == 0 {
            // Nothing to hold: no pooled buffer is lent (and none is given back on drop).
            return Ok(HostScratch {
                gpu: self.clone(),
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                cap: 0,
                len,
            });
        }
        let mut pool = self.host_scratch.lock().unwrap_or_else(|e| e.into_inner());
        let best = (0..pool.len())
            .filter(|&i| pool[i].1 >= bytes)
            .min_by_key(|&i| pool[i].1);
        let (ptr, cap) = match best {
            Some(i) => pool.swap_remove(i),
            None => {
                drop(pool);
                let cap = bytes.next_power_of_two().max(1 << 18);
                (alloc_host(self, cap)? as usize, cap)
            }
        };
        Ok(HostScratch {
            gpu: self.clone(),
            ptr: ptr as *mut T,
            cap,
            len,
        })
    }
}

impl<T: Copy> super::DevSlice<'_, T> {
    /// The range's values downloaded into page-locked scratch of its GPU's pool
    /// ([`Gpu::host_scratch`]; waits for the stream).
    pub fn to_scratch(&self) -> Result<HostScratch<T>, CudaError> {
        let mut s = self.gpu().host_scratch(self.len())?;
        self.read_into(&mut s)?;
        Ok(s)
    }
}

/// Page-locked host memory lent by a GPU's pool ([`Gpu::host_scratch`]): where ranks share a
/// GPU, the own engine stages a GPU buffer's values through one for a collective or message
/// over the host transports — the copy engine writes and reads it directly, and the
/// collective works on it in place. Returned to the pool when dropped (freed with the GPU).
pub struct HostScratch<T: Copy = f32> {
    gpu: Arc<Gpu>,
    ptr: *mut T,
    /// Bytes of the pooled buffer.
    cap: usize,
    len: usize,
}

// SAFETY: host memory this lease alone reaches until it drops.
unsafe impl<T: Copy + Send> Send for HostScratch<T> {}
unsafe impl<T: Copy + Sync> Sync for HostScratch<T> {}

impl<T: Copy> std::ops::Deref for HostScratch<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` elements (`len · size_of::<T>() <= cap` bytes) of memory owned by
        // the lease, initialised (zeroed when made, written since only as `T`s or other plain
        // numbers, every bit pattern of which is a valid `T`); a lease of no bytes has an
        // aligned dangling pointer, valid for them.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: Copy> std::ops::DerefMut for HostScratch<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`; no copy reads it now (uploads from page-locked memory wait
        // for their copy, [`is_pinned`]).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: Copy> AsRef<[T]> for HostScratch<T> {
    fn as_ref(&self) -> &[T] {
        self
    }
}

impl<T: Copy> AsMut<[T]> for HostScratch<T> {
    fn as_mut(&mut self) -> &mut [T] {
        self
    }
}

impl<T: Copy> Drop for HostScratch<T> {
    fn drop(&mut self) {
        if self.cap == 0 {
            return;
        }
        self.gpu
            .host_scratch
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((self.ptr as usize, self.cap));
    }
}

impl<T: Copy> std::fmt::Debug for HostScratch<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HostScratch<{}>[{}] ({} bytes) for cuda:{}",
            std::any::type_name::<T>(),
            self.len,
            self.cap,
            self.gpu.info.ordinal
        )
    }
}

impl<T: Copy> std::ops::Deref for Pinned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        // SAFETY: `len` initialised elements owned by `self` (dangling only when empty).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl<T: Copy> std::ops::DerefMut for Pinned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, borrowed mutably through `self`. No copy reads it now: an
        // upload from it waited for its copy ([`is_pinned`]).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl<T: Copy> Drop for Pinned<T> {
    fn drop(&mut self) {
        if self.len * std::mem::size_of::<T>() > 0 {
            free_host(&self.gpu, self.ptr as *mut c_void);
        }
    }
}

impl<T: Copy> std::fmt::Debug for Pinned<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Pinned<{}>[{}] for cuda:{}",
            std::any::type_name::<T>(),
            self.len,
            self.gpu.info.ordinal
        )
    }
}

/// A [`Pinned`] buffer whose copies to and from the GPU run on a stream of its own, so that
/// the host and the compute stream go on while the copy engine moves the data: ZeRO-Offload's
/// gradients land in one during the backward, bucket by bucket, and its rounded weights go up
/// from two while the host updates the next chunk.
///
/// Ordering: a download ([`Staged::download`]) starts after the work queued on the compute
/// stream so far (which wrote its source); an upload ([`Staged::upload`]) also, and the
/// compute stream's later work starts after it (it reads the new values). The host reaches
/// the buffer only through [`Staged::host`], which first waits for the queued copies: the
/// copy engine and the host never touch it at once. A dropped `Staged` waits for its copies
/// too. The caller keeps a download's source unchanged until it has waited (no compute work
/// queued after the download writes it): the copy reads it later.
pub struct Staged<T: Copy> {
    buf: Pinned<T>,
    stream: super::driver::Stream,
    /// The event after the last copy queued: `None` when none is in flight.
    in_flight: Option<super::driver::Event>,
}

impl<T: Copy> Staged<T> {
    /// `len` zeroed page-locked elements with a new stream of their own on `gpu`.
    pub fn new(gpu: &Arc<Gpu>, len: usize) -> Result<Self, CudaError> {
        Ok(Staged {
            buf: gpu.pinned(len)?,
            stream: gpu.side_stream()?,
            in_flight: None,
        })
    }

    pub fn len(&self) -> usize {
        self.buf.len
    }

    pub fn is_empty(&self) -> bool {
        self.buf.len == 0
    }

    /// The GPU whose copies it stages.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.buf.gpu
    }

    /// The buffer on the host when no copy is in flight (one waited for by [`Self::host`]).
    pub fn settled(&self) -> Option<&[T]> {
        self.in_flight.is_none().then_some(&*self.buf)
    }

    /// [`Self::settled`], to write: no call into the driver, so any thread may make it.
    pub fn settled_mut(&mut self) -> Option<&mut [T]> {
        self.in_flight.is_none().then_some(&mut *self.buf)
    }

    /// Queues the copy of `src` into elements `at..at + src.len()`, behind the compute
    /// stream's queued work; returns at once.
    pub fn download(&mut self, at: usize, src: super::DevSlice<'_, T>) -> Result<(), CudaError> {
        let bytes = src.len() * std::mem::size_of::<T>();
        self.check_range(at, src.len(), "download")?;
        let gpu = &self.buf.gpu;
        self.after_compute()?;
        // SAFETY: elements `at..` of the buffer are in bounds (checked) and stay allocated
        // until the copy is waited for (`host` and `drop` wait for `in_flight`); the host does
        // not touch them before.
        let dst = unsafe { self.buf.ptr.add(at) } as *mut c_void;
        if bytes > 0 {
            check(
                unsafe {
                    (gpu.lib.cuMemcpyDtoHAsync_v2)(
                        dst,
                        src.ptr(),
                        bytes,
                        gpu.stream_of(self.stream)?,
                    )
                },
                "cuMemcpyDtoHAsync (a staged download)",
            )?;
        }
        self.in_flight = Some(gpu.record(self.stream)?);
        Ok(())
    }

    /// Queues the copy of elements `range` into `dst` (same length), behind the compute
    /// stream's queued work and ahead of its later work; returns at once.
    pub fn upload(
        &mut self,
        range: std::ops::Range<usize>,
        dst: super::DevSliceMut<'_, T>,
    ) -> Result<(), CudaError> {
        let done = self.queue_upload(range, dst)?;
        self.buf
            .gpu
            .wait_for(super::driver::Stream::Compute, &done)?;
        self.in_flight = Some(done);
        Ok(())
    }

    /// [`Self::upload`] without ordering the compute stream's later work after it: the copy
    /// runs while the compute stream goes on, and the caller makes the compute stream wait
    /// ([`Unordered::order_compute`]) before it first reads `dst`.
    pub fn upload_unordered(
        &mut self,
        range: std::ops::Range<usize>,
        dst: super::DevSliceMut<'_, T>,
    ) -> Result<Unordered, CudaError> {
        let done = self.queue_upload(range, dst)?;
        let gpu = self.buf.gpu.clone();
        self.in_flight = Some(gpu.record(self.stream)?);
        Ok(Unordered { gpu, done })
    }

    /// Queues the copy of [`Self::upload`] on this buffer's stream, behind the compute
    /// stream's queued work; returns the event after it.
    fn queue_upload(
        &mut self,
        range: std::ops::Range<usize>,
        dst: super::DevSliceMut<'_, T>,
    ) -> Result<super::driver::Event, CudaError> {
        if range.len() != dst.len() {
            return Err(CudaError::Shape(format!(
                "staged upload of {} elements into {}",
                range.len(),
                dst.len()
            )));
        }
        self.check_range(range.start, range.len(), "upload")?;
        let gpu = self.buf.gpu.clone();
        self.after_compute()?;
        let bytes = range.len() * std::mem::size_of::<T>();
        if bytes > 0 {
            // SAFETY: in bounds (checked); the host does not write the buffer before the
            // copy is waited for (`host`).
            let src = unsafe { self.buf.ptr.add(range.start) } as *const c_void;
            check(
                unsafe {
                    (gpu.lib.cuMemcpyHtoDAsync_v2)(
                        dst.ptr(),
                        src,
                        bytes,
                        gpu.stream_of(self.stream)?,
                    )
                },
                "cuMemcpyHtoDAsync (a staged upload)",
            )?;
        }
        gpu.record(self.stream)
    }

    /// The buffer on the host, once the queued copies have finished.
    pub fn host(&mut self) -> Result<&mut [T], CudaError> {
        if let Some(e) = self.in_flight.take() {
            e.synchronize()?;
        }
        Ok(&mut self.buf)
    }

    /// Makes this buffer's stream wait for the compute stream's queued work.
    fn after_compute(&self) -> Result<(), CudaError> {
        let gpu = &self.buf.gpu;
        let queued = gpu.record(super::driver::Stream::Compute)?;
        gpu.wait_for(self.stream, &queued)
    }

    fn check_range(&self, at: usize, n: usize, what: &str) -> Result<(), CudaError> {
        if at + n > self.buf.len {
            return Err(CudaError::Shape(format!(
                "staged {what} of {n} elements at {at} into a buffer of {}",
                self.buf.len
            )));
        }
        Ok(())
    }
}

/// A staged upload the compute stream is not yet ordered after ([`Staged::upload_unordered`]).
pub struct Unordered {
    gpu: Arc<Gpu>,
    done: super::driver::Event,
}

impl Unordered {
    /// Makes the compute stream's work queued from now on wait for the upload.
    pub fn order_compute(&self) -> Result<(), CudaError> {
        self.gpu
            .wait_for(super::driver::Stream::Compute, &self.done)
    }
}

impl std::fmt::Debug for Unordered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Unordered")
    }
}

impl<T: Copy> Drop for Staged<T> {
    fn drop(&mut self) {
        // The copy engine may still write or read the buffer: wait before it is freed (a
        // failed context copies nothing more).
        if let Some(e) = self.in_flight.take() {
            let _ = e.synchronize();
        }
    }
}

impl<T: Copy> std::fmt::Debug for Staged<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Staged({:?})", self.buf)
    }
}
