//! Page-locked ("pinned") host memory: [`Pinned`], host buffers the GPU's copy engine reads
//! and writes directly.
//!
//! A copy between a GPU and ordinary (pageable) host memory goes through the driver's own
//! pinned staging buffers, a chunk at a time, at a fraction of the link's bandwidth; into or out
//! of page-locked memory it is one DMA transfer at the link's speed (CUDA C Programming Guide,
//! "Page-Locked Host Memory"). Page-locked memory is a scarce resource of the host (it cannot
//! be swapped), so xtrain keeps it for the buffers that carry the bulk of a step's host
//! traffic and holds them across steps: ZeRO-Offload's gradient and weight chunks
//! (`parallel::executor::optimizer`), `xtrain bench comm --device cuda`'s staged buffers.
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

impl Gpu {
    /// `len` zeroed elements of page-locked host memory for copies with this GPU. `T` must be
    /// a plain number type (all-zero bytes a valid value), as for [`Gpu::zeros`].
    pub fn pinned<T: Copy>(self: &Arc<Self>, len: usize) -> Result<Pinned<T>, CudaError> {
        let bytes = len * std::mem::size_of::<T>();
        if bytes == 0 {
            return Ok(Pinned {
                ptr: std::ptr::NonNull::dangling().as_ptr(),
                len,
                gpu: self.clone(),
            });
        }
        self.bind()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the memory is freed in `drop`.
        check(
            unsafe { (self.lib.cuMemAllocHost_v2)(&mut p, bytes) },
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
        Ok(Pinned {
            ptr: p as *mut T,
            len,
            gpu: self.clone(),
        })
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
        if self.len * std::mem::size_of::<T>() == 0 {
            return;
        }
        let start = self.ptr as usize;
        LIVE.lock()
            .unwrap_or_else(|x| x.into_inner())
            .retain(|&(a, _)| a != start);
        // A download into it may still be queued (its caller waits for it, but may have
        // failed before); a failed context copies nothing more.
        let _ = self.gpu.synchronize();
        if self.gpu.bind().is_ok() {
            // SAFETY: memory from cuMemAllocHost, no longer referenced.
            unsafe { (self.gpu.lib.cuMemFreeHost)(self.ptr as *mut c_void) };
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
