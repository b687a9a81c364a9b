//! The GPU a process uses: the driver's primary context on one device, one compute stream,
//! the kernel modules compiled for it, the caching allocator and the cuBLASLt handle
//! ([`Gpu`]); device buffers ([`DevBuf`]); kernel launches ([`KArg`], [`Gpu::launch`]).
//!
//! Every call makes the context current on the calling thread first (cheap), so any thread of
//! the process may use the `Gpu`. Kernels and copies go to the one compute stream in order, so
//! a buffer freed after a kernel that reads it may be handed to the next kernel at once
//! (stream order), and the host only waits where it reads results ([`DevBuf::to_host`]).
//!
//! A second stream carries communication ([`Stream::Comm`]: NCCL's collectives where a
//! communicator is put there), ordered against the compute stream by [`Event`]s: the compute
//! stream records an event where the data to send is final, the communication stream waits for
//! it, runs the collective and records its own event, and the compute stream waits for that
//! one before it reads the result — so the collective overlaps the kernels queued between.
//! The caching allocator knows the compute stream only: a buffer the communication stream
//! reads or writes is kept alive until the compute stream has waited for the collective's
//! event (after that, compute-stream order covers it again).
//!
//! Further streams ([`Gpu::side_stream`], [`Stream::Side`]) follow the same rules; they carry
//! traffic that must not queue behind the communication stream's (a pipeline link's messages,
//! each link in its own order).

use super::alloc::Allocator;
use super::sys::{self, CUcontext, CUdevice, CUdeviceptr, CUfunction, CUmodule, CUstream};
use super::timeline::Timed;
use super::{nvrtc, CudaError};
use std::collections::HashMap;
use std::ffi::{c_void, CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// The result of a driver call as an error naming the call.
pub(crate) fn check(r: sys::CUresult, call: &str) -> Result<(), CudaError> {
    if r == sys::CUDA_SUCCESS {
        return Ok(());
    }
    Err(CudaError::Driver {
        call: call.to_string(),
        code: r,
        message: error_text(r),
    })
}

/// `NAME: description` of a driver result code.
pub(crate) fn error_text(r: sys::CUresult) -> String {
    let Ok(lib) = sys::driver() else {
        return format!("CUDA error {r}");
    };
    let mut name: *const std::ffi::c_char = std::ptr::null();
    let mut text: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: both calls write a pointer to a static string (or leave it null).
    unsafe {
        (lib.cuGetErrorName)(r, &mut name);
        (lib.cuGetErrorString)(r, &mut text);
    }
    let s = |p: *const std::ffi::c_char| {
        if p.is_null() {
            String::new()
        } else {
            // SAFETY: non-null pointers from the driver are NUL-terminated static strings.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    format!("{}: {}", s(name), s(text))
}

/// What the driver reports of a device.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// Compute capability `(major, minor)`, e.g. `(9, 0)` for an H100.
    pub capability: (i32, i32),
    pub multiprocessors: i32,
    /// Shared memory a block may opt in to, in bytes.
    pub shared_per_block: i32,
    pub total_memory: usize,
    /// The driver's CUDA version, e.g. 13000.
    pub driver_version: i32,
}

impl DeviceInfo {
    /// The `sm_XY` architecture number NVRTC compiles for.
    pub fn arch(&self) -> u32 {
        (self.capability.0 * 10 + self.capability.1) as u32
    }

    /// The device's dense bf16 tensor-core peak in FLOP/s, for utilisation figures: from the
    /// vendors' data sheets by name (SXM parts; `None` for a device not in the table).
    pub fn bf16_peak_flops(&self) -> Option<f64> {
        let n = self.name.to_ascii_uppercase();
        let tflops = if n.contains("H200") || n.contains("H100") && !n.contains("PCIE") {
            989.4
        } else if n.contains("H100") {
            756.0
        } else if n.contains("A100") {
            312.0
        } else if n.contains("L40S") {
            362.1
        } else if n.contains("A10G") {
            70.0
        } else {
            return None;
        };
        Some(tflops * 1e12)
    }
}

/// Number of CUDA devices (an error when the driver is missing or cannot start).
pub fn device_count() -> Result<usize, CudaError> {
    let lib = init()?;
    let mut n = 0;
    // SAFETY: valid out-pointer, after cuInit.
    check(
        unsafe { (lib.cuDeviceGetCount)(&mut n) },
        "cuDeviceGetCount",
    )?;
    Ok(n.max(0) as usize)
}

/// The driver, initialised once (`cuInit`), at CUDA 12 or newer.
fn init() -> Result<&'static sys::Driver, CudaError> {
    static INIT: OnceLock<Result<(), CudaError>> = OnceLock::new();
    let lib = sys::driver().map_err(CudaError::Library)?;
    INIT.get_or_init(|| {
        // SAFETY: cuInit(0) may be called any number of times.
        let r = unsafe { (lib.cuInit)(0) };
        if r == sys::CUDA_ERROR_NO_DEVICE {
            return Err(CudaError::NoDevice(
                "the NVIDIA driver found no GPU on this machine".into(),
            ));
        }
        check(r, "cuInit")?;
        let mut v = 0;
        // SAFETY: valid out-pointer.
        check(unsafe { (lib.cuDriverGetVersion)(&mut v) }, "cuDriverGetVersion")?;
        if v < 12000 {
            return Err(CudaError::NoDevice(format!(
                "the NVIDIA driver supports CUDA {}.{}; xtrain needs CUDA 12.0 or newer (update the driver)",
                v / 1000,
                v % 1000 / 10
            )));
        }
        Ok(())
    })
    .clone()?;
    Ok(lib)
}

/// A device buffer of `len` elements of `T` from the [`Gpu`]'s caching allocator; returned to
/// it on drop.
pub struct DevBuf<T> {
    ptr: CUdeviceptr,
    len: usize,
    gpu: Arc<Gpu>,
    _t: std::marker::PhantomData<T>,
}

// SAFETY: a device pointer is an integer; the memory is only touched through the stream.
unsafe impl<T: Send> Send for DevBuf<T> {}
unsafe impl<T: Sync> Sync for DevBuf<T> {}

impl<T: Copy> DevBuf<T> {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address (for kernel arguments and library calls).
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }

    /// The device address of element `i`.
    pub fn ptr_at(&self, i: usize) -> CUdeviceptr {
        assert!(i <= self.len, "DevBuf::ptr_at({i}) beyond {}", self.len);
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }

    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }

    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// Copies the buffer to the host (waits for the stream).
    pub fn to_host(&self) -> Result<Vec<T>, CudaError> {
        copy_to_host(&self.gpu, self.ptr, self.len)
    }

    /// Overwrites the buffer with `src` (same length).
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<(), CudaError> {
        copy_from_host(&self.gpu, self.ptr, self.len, src)
    }

    /// The whole buffer as a read-only view.
    pub fn as_slice(&self) -> DevSlice<'_, T> {
        DevSlice::from(self)
    }

    /// The whole buffer as a mutable view.
    pub fn as_mut_slice(&mut self) -> DevSliceMut<'_, T> {
        DevSliceMut::from(self)
    }

    /// The range `r` as a read-only view.
    pub fn slice(&self, r: std::ops::Range<usize>) -> DevSlice<'_, T> {
        self.as_slice().slice(r)
    }

    /// The range `r` as a mutable view.
    pub fn slice_mut(&mut self, r: std::ops::Range<usize>) -> DevSliceMut<'_, T> {
        self.as_mut_slice().slice_mut(r)
    }

    /// Copies `len` elements from `src[src_at..]` into `self[at..]` on the device.
    pub fn copy_within_device(
        &mut self,
        at: usize,
        src: &DevBuf<T>,
        src_at: usize,
        len: usize,
    ) -> Result<(), CudaError> {
        if at + len > self.len || src_at + len > src.len {
            return Err(CudaError::Shape(format!(
                "device copy of {len} elements: [{src_at}..] of {} into [{at}..] of {}",
                src.len, self.len
            )));
        }
        self.gpu.bind()?;
        let size = std::mem::size_of::<T>();
        // SAFETY: both ranges are in bounds (checked above).
        self.gpu.timed(Timed::Copy("device to device"), || {
            check(
                unsafe {
                    (self.gpu.lib.cuMemcpyDtoDAsync_v2)(
                        self.ptr_at(at),
                        src.ptr_at(src_at),
                        len * size,
                        self.gpu.stream,
                    )
                },
                "cuMemcpyDtoDAsync",
            )
        })
    }

    /// Sets every byte to zero (stream-ordered).
    pub fn zero(&mut self) -> Result<(), CudaError> {
        self.gpu.bind()?;
        // SAFETY: the buffer's bytes.
        self.gpu.timed(Timed::Copy("memset"), || {
            check(
                unsafe {
                    (self.gpu.lib.cuMemsetD8Async)(self.ptr, 0, self.bytes(), self.gpu.stream)
                },
                "cuMemsetD8Async",
            )
        })
    }
}

impl<T> Drop for DevBuf<T> {
    fn drop(&mut self) {
        self.gpu
            .alloc
            .release(self.ptr, self.len * std::mem::size_of::<T>());
    }
}

/// A borrowed range of a [`DevBuf`] (a device address, a length and the device): what the
/// kernel launchers read.
pub struct DevSlice<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    gpu: &'a Arc<Gpu>,
    _t: std::marker::PhantomData<&'a T>,
}

/// A mutably borrowed range of a [`DevBuf`]: what the kernel launchers write.
pub struct DevSliceMut<'a, T> {
    ptr: CUdeviceptr,
    len: usize,
    gpu: &'a Arc<Gpu>,
    _t: std::marker::PhantomData<&'a mut T>,
}

impl<T> Clone for DevSlice<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DevSlice<'_, T> {}

impl<'a, T: Copy> DevSlice<'a, T> {
    /// `len` elements at device address `ptr` on `gpu`.
    ///
    /// # Safety
    /// The range must lie inside an allocation on `gpu` that stays allocated, and is not
    /// written through another handle, for `'a`.
    pub(crate) unsafe fn from_raw_parts(gpu: &'a Arc<Gpu>, ptr: CUdeviceptr, len: usize) -> Self {
        DevSlice {
            ptr,
            len,
            gpu,
            _t: std::marker::PhantomData,
        }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    pub fn gpu(&self) -> &'a Arc<Gpu> {
        self.gpu
    }
    /// The sub-range `r` (panics beyond the end, as slicing does).
    pub fn slice(self, r: std::ops::Range<usize>) -> DevSlice<'a, T> {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "DevSlice {r:?} of {}",
            self.len
        );
        DevSlice {
            ptr: self.ptr + (r.start * std::mem::size_of::<T>()) as u64,
            len: r.end - r.start,
            gpu: self.gpu,
            _t: std::marker::PhantomData,
        }
    }
    /// Copies the range to the host (waits for the stream).
    pub fn to_host(&self) -> Result<Vec<T>, CudaError> {
        copy_to_host(self.gpu, self.ptr, self.len)
    }
    /// Copies the range into host slice `out` (same length; waits for the stream): straight
    /// into `out`, by the copy engine alone where `out` is page-locked ([`super::Pinned`]).
    pub fn read_into(&self, out: &mut [T]) -> Result<(), CudaError> {
        if out.len() != self.len {
            return Err(CudaError::Shape(format!(
                "read_into: {} elements into a host slice of {}",
                self.len,
                out.len()
            )));
        }
        // SAFETY: `out` is writable for the range's bytes.
        unsafe {
            download(
                self.gpu,
                self.ptr,
                out.as_mut_ptr() as *mut c_void,
                self.bytes(),
            )
        }
    }
    fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
}

impl<'a, T: Copy> DevSliceMut<'a, T> {
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn ptr(&self) -> CUdeviceptr {
        self.ptr
    }
    pub fn gpu(&self) -> &'a Arc<Gpu> {
        self.gpu
    }
    /// A shorter-lived mutable view of the same range.
    pub fn reborrow(&mut self) -> DevSliceMut<'_, T> {
        DevSliceMut {
            ptr: self.ptr,
            len: self.len,
            gpu: self.gpu,
            _t: std::marker::PhantomData,
        }
    }
    /// A read-only view of the same range.
    pub fn as_ref(&self) -> DevSlice<'_, T> {
        DevSlice {
            ptr: self.ptr,
            len: self.len,
            gpu: self.gpu,
            _t: std::marker::PhantomData,
        }
    }
    /// The sub-range `r` (panics beyond the end).
    pub fn slice_mut(self, r: std::ops::Range<usize>) -> DevSliceMut<'a, T> {
        assert!(
            r.start <= r.end && r.end <= self.len,
            "DevSliceMut {r:?} of {}",
            self.len
        );
        DevSliceMut {
            ptr: self.ptr + (r.start * std::mem::size_of::<T>()) as u64,
            len: r.end - r.start,
            gpu: self.gpu,
            _t: std::marker::PhantomData,
        }
    }
    /// The range cut in two at `mid` (panics beyond the end, as `split_at_mut` does).
    pub fn split_at(self, mid: usize) -> (DevSliceMut<'a, T>, DevSliceMut<'a, T>) {
        assert!(
            mid <= self.len,
            "DevSliceMut split at {mid} of {}",
            self.len
        );
        let right = DevSliceMut {
            ptr: self.ptr + (mid * std::mem::size_of::<T>()) as u64,
            len: self.len - mid,
            gpu: self.gpu,
            _t: std::marker::PhantomData,
        };
        let left = DevSliceMut { len: mid, ..self };
        (left, right)
    }

    /// Overwrites the range with `src` (same length; waits for the copy).
    pub fn copy_from_host(&mut self, src: &[T]) -> Result<(), CudaError> {
        copy_from_host(self.gpu, self.ptr, self.len, src)
    }
    /// Copies `src` (same length) into the range, on the device.
    pub fn copy_from(&mut self, src: DevSlice<'_, T>) -> Result<(), CudaError> {
        if src.len != self.len {
            return Err(CudaError::Shape(format!(
                "device copy of {} elements into {}",
                src.len, self.len
            )));
        }
        self.gpu.bind()?;
        // SAFETY: both ranges hold `len` elements of `T` on this device.
        self.gpu.timed(Timed::Copy("device to device"), || {
            check(
                unsafe {
                    (self.gpu.lib.cuMemcpyDtoDAsync_v2)(
                        self.ptr,
                        src.ptr,
                        self.len * std::mem::size_of::<T>(),
                        self.gpu.stream,
                    )
                },
                "cuMemcpyDtoDAsync",
            )
        })
    }
    /// Sets every byte of the range to zero (stream-ordered).
    pub fn zero(&mut self) -> Result<(), CudaError> {
        self.gpu.bind()?;
        // SAFETY: the range's bytes.
        self.gpu.timed(Timed::Copy("memset"), || {
            check(
                unsafe {
                    (self.gpu.lib.cuMemsetD8Async)(
                        self.ptr,
                        0,
                        self.len * std::mem::size_of::<T>(),
                        self.gpu.stream,
                    )
                },
                "cuMemsetD8Async",
            )
        })
    }
}

impl<'a, T> From<&'a DevBuf<T>> for DevSlice<'a, T> {
    fn from(b: &'a DevBuf<T>) -> Self {
        DevSlice {
            ptr: b.ptr,
            len: b.len,
            gpu: &b.gpu,
            _t: std::marker::PhantomData,
        }
    }
}

impl<'a, T> From<&'a mut DevBuf<T>> for DevSlice<'a, T> {
    fn from(b: &'a mut DevBuf<T>) -> Self {
        DevSlice::from(&*b)
    }
}

impl<'a, T> From<&'a mut DevBuf<T>> for DevSliceMut<'a, T> {
    fn from(b: &'a mut DevBuf<T>) -> Self {
        DevSliceMut {
            ptr: b.ptr,
            len: b.len,
            gpu: &b.gpu,
            _t: std::marker::PhantomData,
        }
    }
}

impl<T: Copy> From<DevSlice<'_, T>> for KArg {
    fn from(s: DevSlice<'_, T>) -> KArg {
        KArg::Ptr(s.ptr)
    }
}

impl<T: Copy> From<&DevSliceMut<'_, T>> for KArg {
    fn from(s: &DevSliceMut<'_, T>) -> KArg {
        KArg::Ptr(s.ptr)
    }
}

/// `len` elements at device address `ptr` copied to a new host vector (waits for the stream).
fn copy_to_host<T: Copy>(gpu: &Gpu, ptr: CUdeviceptr, len: usize) -> Result<Vec<T>, CudaError> {
    let mut out = Vec::<T>::with_capacity(len);
    // SAFETY: `out` has capacity for `len` elements; the copy has completed when `download`
    // returns Ok (stream synchronised), before `set_len`.
    unsafe {
        download(
            gpu,
            ptr,
            out.as_mut_ptr() as *mut c_void,
            len * std::mem::size_of::<T>(),
        )?;
        out.set_len(len);
    }
    Ok(out)
}

/// `bytes` bytes at device address `ptr` copied to host address `dst`, waiting for the stream
/// (also when there is nothing to copy: a download is a wait for the queue).
///
/// # Safety
/// `dst` must be valid for writes of `bytes` bytes until the call returns.
unsafe fn download(
    gpu: &Gpu,
    ptr: CUdeviceptr,
    dst: *mut c_void,
    bytes: usize,
) -> Result<(), CudaError> {
    gpu.bind()?;
    if bytes > 0 {
        gpu.timed(Timed::Copy("device to host"), || {
            check(
                (gpu.lib.cuMemcpyDtoHAsync_v2)(dst, ptr, bytes, gpu.stream),
                "cuMemcpyDtoHAsync",
            )
        })?;
    }
    gpu.synchronize()
}

/// `src` copied to `len` elements at device address `ptr`, queued on the stream without
/// waiting for it: `src` is pageable memory, which the driver must stage into pinned memory
/// of its own to copy it (CUDA's "API synchronization behavior": "if pageable memory must
/// first be staged to pinned memory, the driver may synchronize with the stream and stage the
/// copy"), and it stages it during the call: the caller frees or reuses `src` at once (every
/// caller here does), and the stream orders the copy before every later kernel that reads the
/// destination. A step's small uploads (token ids, targets, routing lists) then no longer
/// drain the queue of kernels ahead of them. The documentation promises the staging only for
/// the synchronous copy; every GPU test passed with this on an H200 (driver 580.159.04), and
/// a pinned staging ring with an event per slot is the way to need no such reading.
///
/// From page-locked memory ([`super::Pinned`]) the copy is a DMA that reads `src` after the
/// call has returned: then the call waits for the stream, so that the caller may still reuse
/// `src` at once.
fn copy_from_host<T: Copy>(
    gpu: &Gpu,
    ptr: CUdeviceptr,
    len: usize,
    src: &[T],
) -> Result<(), CudaError> {
    if src.len() != len {
        return Err(CudaError::Shape(format!(
            "copy_from_host: {} elements into a buffer of {len}",
            src.len()
        )));
    }
    if len == 0 {
        return Ok(()); // nothing to queue (an empty exchange's rows, say)
    }
    gpu.bind()?;
    let bytes = len * std::mem::size_of::<T>();
    let src = src.as_ptr() as *const c_void;
    // SAFETY: `src` holds `len` elements; the device range as well.
    gpu.timed(Timed::Copy("host to device"), || unsafe {
        check(
            (gpu.lib.cuMemcpyHtoDAsync_v2)(ptr, src, bytes, gpu.stream),
            "cuMemcpyHtoDAsync",
        )
    })?;
    if super::pinned::is_pinned(src, bytes) {
        gpu.synchronize()?;
    }
    Ok(())
}

impl<T> std::fmt::Debug for DevBuf<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DevBuf<{}>[{}] on cuda:{}",
            std::any::type_name::<T>(),
            self.len,
            self.gpu.info.ordinal
        )
    }
}

/// One kernel argument, held where the launch can point at it.
#[derive(Clone, Copy, Debug)]
pub enum KArg {
    Ptr(CUdeviceptr),
    I32(i32),
    U32(u32),
    I64(i64),
    F32(f32),
}

impl KArg {
    fn as_param(&mut self) -> *mut c_void {
        match self {
            KArg::Ptr(p) => p as *mut u64 as *mut c_void,
            KArg::I32(v) => v as *mut i32 as *mut c_void,
            KArg::U32(v) => v as *mut u32 as *mut c_void,
            KArg::I64(v) => v as *mut i64 as *mut c_void,
            KArg::F32(v) => v as *mut f32 as *mut c_void,
        }
    }
}

impl<T: Copy> From<&DevBuf<T>> for KArg {
    fn from(b: &DevBuf<T>) -> KArg {
        KArg::Ptr(b.ptr)
    }
}

impl<T: Copy> From<&mut DevBuf<T>> for KArg {
    fn from(b: &mut DevBuf<T>) -> KArg {
        KArg::Ptr(b.ptr)
    }
}

impl From<i32> for KArg {
    fn from(v: i32) -> KArg {
        KArg::I32(v)
    }
}

impl From<f32> for KArg {
    fn from(v: f32) -> KArg {
        KArg::F32(v)
    }
}

/// `v` as a 32-bit kernel argument, or an error naming it when it does not fit.
pub fn to_i32(v: usize, what: &str) -> Result<i32, CudaError> {
    i32::try_from(v).map_err(|_| CudaError::Shape(format!("{what} = {v} exceeds 2^31 - 1")))
}

/// Dynamic shared memory a kernel may use without opting in (48 KiB).
const DEFAULT_DYNAMIC_SHARED: u32 = 48 * 1024;

/// Grid, block and dynamic shared memory of a launch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchCfg {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

impl LaunchCfg {
    /// A 1-D launch of `blocks` blocks of `threads` threads; no blocks (an empty input) is
    /// no launch ([`Gpu::launch`] skips it: a kernel with one block per row must not run
    /// on zero rows, where its one block would read and write a row that is not there).
    pub fn linear(blocks: usize, threads: u32) -> LaunchCfg {
        LaunchCfg {
            grid: (blocks as u32, 1, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
        }
    }

    /// Enough blocks of `threads` threads for `n` elements (one per thread).
    pub fn for_elements(n: usize, threads: u32) -> LaunchCfg {
        LaunchCfg::linear(n.div_ceil(threads as usize), threads)
    }
}

/// One device, its context, stream, kernels, allocator and cuBLASLt handle.
pub struct Gpu {
    pub(crate) lib: &'static sys::Driver,
    pub info: DeviceInfo,
    ctx: CUcontext,
    pub(crate) stream: CUstream,
    /// The communication stream ([`Stream::Comm`]).
    comm_stream: CUstream,
    /// The side streams made so far ([`Gpu::side_stream`]), by index.
    side_streams: Mutex<Vec<CUstream>>,
    modules: Mutex<HashMap<&'static str, CUmodule>>,
    functions: Mutex<HashMap<(&'static str, &'static str), CUfunction>>,
    /// Dynamic shared memory each function was allowed beyond the default.
    dynamic_shared: Mutex<HashMap<(&'static str, &'static str), u32>>,
    pub(crate) alloc: Allocator,
    pub(crate) blas: Mutex<Option<super::blas::Blas>>,
    /// What a host wait checks while it waits ([`Gpu::watch`]).
    watch: Mutex<Option<Arc<Watch>>>,
    /// Device time per kernel, while switched on ([`Gpu::time_kernels`]).
    pub(crate) timeline: super::timeline::Timeline,
    /// The page-locked scratch buffers not lent out ([`Gpu::host_scratch`]): address and
    /// capacity in bytes.
    pub(crate) host_scratch: Mutex<Vec<(usize, usize)>>,
}

/// A limit on the host's waits for a GPU and a check run while it waits
/// ([`Gpu::watch`]): where ranks run collectives on the device (NCCL), a peer that stopped
/// leaves this GPU's queue waiting for it forever, and the host in `cuStreamSynchronize` with
/// it; with a watch the wait polls, runs `check` (the communicators' background errors) and
/// gives up after `limit`, with an error naming what was being waited for.
pub struct Watch {
    pub limit: std::time::Duration,
    /// What the GPU's queue may be waiting for (named in the error after `limit`).
    pub what: String,
    /// An error found while waiting (e.g. NCCL's asynchronous error of a communicator).
    pub check: Box<dyn Fn() -> Result<(), String> + Send + Sync>,
}

// SAFETY: the driver's handles may be used from any thread once the context is current there
// (`bind`); the maps are behind mutexes.
unsafe impl Send for Gpu {}
unsafe impl Sync for Gpu {}

impl Gpu {
    /// Device `ordinal`, opened once per process (its primary context and a non-blocking
    /// stream) and shared by every caller: a clear error when there is no driver, no such
    /// device, or the driver is older than CUDA 12.
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>, CudaError> {
        static OPEN: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();
        let mut open = OPEN
            .get_or_init(Default::default)
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(g) = open.get(&ordinal) {
            return Ok(g.clone());
        }
        let g = Self::open_new(ordinal)?;
        open.insert(ordinal, g.clone());
        Ok(g)
    }

    fn open_new(ordinal: usize) -> Result<Arc<Gpu>, CudaError> {
        let lib = init()?;
        let count = device_count()?;
        if ordinal >= count {
            return Err(CudaError::NoDevice(format!(
                "cuda:{ordinal} asked for, but this machine has {count} CUDA device(s)"
            )));
        }
        let mut dev: CUdevice = 0;
        // SAFETY: valid out-pointers throughout; the device exists (checked above).
        unsafe {
            check((lib.cuDeviceGet)(&mut dev, ordinal as i32), "cuDeviceGet")?;
            let mut name = [0 as std::ffi::c_char; 256];
            check(
                (lib.cuDeviceGetName)(name.as_mut_ptr(), name.len() as i32, dev),
                "cuDeviceGetName",
            )?;
            let attr = |a| {
                let mut v = 0;
                check(
                    (lib.cuDeviceGetAttribute)(&mut v, a, dev),
                    "cuDeviceGetAttribute",
                )
                .map(|_| v)
            };
            let mut total = 0usize;
            check(
                (lib.cuDeviceTotalMem_v2)(&mut total, dev),
                "cuDeviceTotalMem",
            )?;
            let mut version = 0;
            check((lib.cuDriverGetVersion)(&mut version), "cuDriverGetVersion")?;
            let info = DeviceInfo {
                ordinal,
                name: CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned(),
                capability: (
                    attr(sys::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                    attr(sys::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
                ),
                multiprocessors: attr(sys::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
                shared_per_block: attr(sys::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
                total_memory: total,
                driver_version: version,
            };
            if info.capability.0 < 8 {
                return Err(CudaError::NoDevice(format!(
                    "{} has compute capability {}.{}; xtrain's kernels need 8.0 or newer (A100, H100, L40, RTX 30xx and later)",
                    info.name, info.capability.0, info.capability.1
                )));
            }
            let mut ctx: CUcontext = std::ptr::null_mut();
            check(
                (lib.cuDevicePrimaryCtxRetain)(&mut ctx, dev),
                "cuDevicePrimaryCtxRetain",
            )?;
            check((lib.cuCtxSetCurrent)(ctx), "cuCtxSetCurrent")?;
            let mut stream: CUstream = std::ptr::null_mut();
            check(
                (lib.cuStreamCreate)(&mut stream, sys::CU_STREAM_NON_BLOCKING),
                "cuStreamCreate",
            )?;
            let mut comm_stream: CUstream = std::ptr::null_mut();
            check(
                (lib.cuStreamCreate)(&mut comm_stream, sys::CU_STREAM_NON_BLOCKING),
                "cuStreamCreate",
            )?;
            Ok(Arc::new(Gpu {
                lib,
                info,
                ctx,
                stream,
                comm_stream,
                side_streams: Mutex::new(Vec::new()),
                modules: Mutex::new(HashMap::new()),
                functions: Mutex::new(HashMap::new()),
                dynamic_shared: Mutex::new(HashMap::new()),
                alloc: Allocator::new(lib),
                blas: Mutex::new(None),
                watch: Mutex::new(None),
                timeline: Default::default(),
                host_scratch: Mutex::new(Vec::new()),
            }))
        }
    }

    /// Makes the context current on this thread.
    pub(crate) fn bind(&self) -> Result<(), CudaError> {
        // SAFETY: the context was retained in `open` and lives as long as `self`.
        check(
            unsafe { (self.lib.cuCtxSetCurrent)(self.ctx) },
            "cuCtxSetCurrent",
        )
    }

    /// Waits until every queued operation finished (within the watch's limit, if one is set).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.bind()?;
        let watch = self.watch.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let Some(w) = watch else {
            // SAFETY: the stream belongs to this context.
            return check(
                unsafe { (self.lib.cuStreamSynchronize)(self.stream) },
                "cuStreamSynchronize",
            );
        };
        let t0 = std::time::Instant::now();
        let mut pause = std::time::Duration::from_micros(5);
        loop {
            // SAFETY: the stream belongs to this context.
            match unsafe { (self.lib.cuStreamQuery)(self.stream) } {
                sys::CUDA_ERROR_NOT_READY => {}
                r => return check(r, "cuStreamQuery"),
            }
            (w.check)().map_err(CudaError::Stalled)?;
            if t0.elapsed() > w.limit {
                return Err(CudaError::Stalled(format!(
                    "cuda:{}: the queued work did not finish within {} s (it waits for {}: a peer stopped, or has not reached its matching call)",
                    self.info.ordinal,
                    w.limit.as_secs_f64(),
                    w.what
                )));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(std::time::Duration::from_micros(200));
        }
    }

    /// Sets (or with `None` clears) the watch of the host's waits for this GPU ([`Watch`]).
    pub fn watch(&self, w: Option<Watch>) {
        *self.watch.lock().unwrap_or_else(|e| e.into_inner()) = w.map(Arc::new);
    }

    /// The driver's handle of stream `s`.
    pub(crate) fn stream_of(&self, s: Stream) -> Result<CUstream, CudaError> {
        match s {
            Stream::Compute => Ok(self.stream),
            Stream::Comm => Ok(self.comm_stream),
            Stream::Side(i) => self
                .side_streams
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .get(i)
                .copied()
                .ok_or_else(|| {
                    CudaError::Shape(format!(
                        "cuda:{} has no side stream {i} (a stream of another GPU?)",
                        self.info.ordinal
                    ))
                }),
        }
    }

    /// A new stream of its own beside the compute and communication streams (non-blocking,
    /// kept until the GPU is closed): for traffic that must not wait behind other traffic,
    /// ordered against the compute stream by events like [`Stream::Comm`].
    pub fn side_stream(&self) -> Result<Stream, CudaError> {
        self.bind()?;
        let mut s: CUstream = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the stream is destroyed in `Drop`.
        check(
            unsafe { (self.lib.cuStreamCreate)(&mut s, sys::CU_STREAM_NON_BLOCKING) },
            "cuStreamCreate",
        )?;
        let mut side = self.side_streams.lock().unwrap_or_else(|e| e.into_inner());
        side.push(s);
        Ok(Stream::Side(side.len() - 1))
    }

    /// An event recorded on stream `on`: it completes when the work queued there before it
    /// has.
    pub fn record(self: &Arc<Self>, on: Stream) -> Result<Event, CudaError> {
        self.bind()?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the event is destroyed by `Event`'s drop.
        check(
            unsafe { (self.lib.cuEventCreate)(&mut ev, sys::CU_EVENT_DISABLE_TIMING) },
            "cuEventCreate",
        )?;
        let event = Event {
            ev,
            gpu: self.clone(),
        };
        // SAFETY: the event and the stream belong to this context.
        check(
            unsafe { (self.lib.cuEventRecord)(ev, self.stream_of(on)?) },
            "cuEventRecord",
        )?;
        Ok(event)
    }

    /// Makes stream `on` wait (on the device; the host goes on) until `event` completed.
    pub fn wait_for(&self, on: Stream, event: &Event) -> Result<(), CudaError> {
        self.bind()?;
        let stream = self.stream_of(on)?;
        // SAFETY: a live event of this context and one of its streams.
        check(
            unsafe { (self.lib.cuStreamWaitEvent)(stream, event.ev, 0) },
            "cuStreamWaitEvent",
        )
    }

    /// A buffer of `len` elements (contents undefined) from the caching allocator.
    pub fn alloc<T: Copy>(self: &Arc<Self>, len: usize) -> Result<DevBuf<T>, CudaError> {
        self.bind()?;
        let bytes = len * std::mem::size_of::<T>();
        let ptr = self.alloc.acquire(bytes)?;
        Ok(DevBuf {
            ptr,
            len,
            gpu: self.clone(),
            _t: std::marker::PhantomData,
        })
    }

    /// A zeroed buffer of `len` elements.
    pub fn zeros<T: Copy>(self: &Arc<Self>, len: usize) -> Result<DevBuf<T>, CudaError> {
        let mut b = self.alloc(len)?;
        b.zero()?;
        Ok(b)
    }

    /// A buffer holding a copy of `src`.
    pub fn upload<T: Copy>(self: &Arc<Self>, src: &[T]) -> Result<DevBuf<T>, CudaError> {
        let mut b = self.alloc(src.len())?;
        b.copy_from_host(src)?;
        Ok(b)
    }

    /// Free and total device memory in bytes (`cuMemGetInfo`).
    pub fn memory_info(&self) -> Result<(usize, usize), CudaError> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers.
        check(
            unsafe { (self.lib.cuMemGetInfo_v2)(&mut free, &mut total) },
            "cuMemGetInfo",
        )?;
        Ok((free, total))
    }

    /// The allocator's counters (live, peak and cached bytes, driver allocations).
    pub fn memory_stats(&self) -> super::alloc::AllocStats {
        self.alloc.stats()
    }

    /// The function `func` of kernel module `module` ([`super::kernels::SOURCES`]), compiled
    /// for this device on first use.
    pub fn function(
        &self,
        module: &'static str,
        func: &'static str,
    ) -> Result<CUfunction, CudaError> {
        if let Some(&f) = self
            .functions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(module, func))
        {
            return Ok(f);
        }
        self.bind()?;
        let m = {
            let mut modules = self.modules.lock().unwrap_or_else(|e| e.into_inner());
            match modules.get(module) {
                Some(&m) => m,
                None => {
                    let source = super::kernels::source(module).ok_or_else(|| {
                        CudaError::Compile(format!("no kernel module named {module}"))
                    })?;
                    let compiled = nvrtc::compile(module, &source, self.info.arch())?;
                    let mut m: CUmodule = std::ptr::null_mut();
                    // SAFETY: a cubin NVRTC produced for this device's architecture.
                    check(
                        unsafe {
                            (self.lib.cuModuleLoadData)(
                                &mut m,
                                compiled.cubin.as_ptr() as *const c_void,
                            )
                        },
                        "cuModuleLoadData",
                    )?;
                    modules.insert(module, m);
                    m
                }
            }
        };
        let name = CString::new(func).expect("kernel names have no NUL");
        let mut f: CUfunction = std::ptr::null_mut();
        // SAFETY: a loaded module and a NUL-terminated name.
        check(
            unsafe { (self.lib.cuModuleGetFunction)(&mut f, m, name.as_ptr()) },
            &format!("cuModuleGetFunction({module}::{func})"),
        )?;
        self.functions
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert((module, func), f);
        Ok(f)
    }

    /// Lets `f` use `bytes` of dynamic shared memory (above the default 48 KiB the driver
    /// needs an opt-in per function). Set to what the launch asks for, never to the device's
    /// whole opt-in size: the driver refuses a maximum that, with the kernel's static shared
    /// memory, exceeds the opt-in size.
    fn allow_dynamic_shared(
        &self,
        f: CUfunction,
        module: &'static str,
        func: &'static str,
        bytes: u32,
    ) -> Result<(), CudaError> {
        let mut allowed = self
            .dynamic_shared
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let have = allowed
            .entry((module, func))
            .or_insert(DEFAULT_DYNAMIC_SHARED);
        if bytes <= *have {
            return Ok(());
        }
        // SAFETY: a valid function handle of this context (current).
        check(
            unsafe {
                (self.lib.cuFuncSetAttribute)(
                    f,
                    sys::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    bytes as i32,
                )
            },
            &format!(
                "cuFuncSetAttribute({module}::{func}, {bytes} bytes of dynamic shared memory; the device allows {})",
                self.info.shared_per_block
            ),
        )?;
        *have = bytes;
        Ok(())
    }

    /// Queues kernel `module::func` with `args` on the compute stream.
    pub fn launch(
        &self,
        module: &'static str,
        func: &'static str,
        cfg: LaunchCfg,
        args: &[KArg],
    ) -> Result<(), CudaError> {
        let f = self.function(module, func)?;
        if cfg.grid.0 == 0 || cfg.grid.1 == 0 || cfg.grid.2 == 0 {
            return Ok(()); // nothing to do
        }
        self.bind()?;
        if cfg.shared_bytes > DEFAULT_DYNAMIC_SHARED {
            self.allow_dynamic_shared(f, module, func, cfg.shared_bytes)?;
        }
        let mut held: Vec<KArg> = args.to_vec();
        let mut params: Vec<*mut c_void> = held.iter_mut().map(KArg::as_param).collect();
        // SAFETY: `params` points into `held`, alive until the call returns (the driver copies
        // the argument values at launch); the kernel's signature is the caller's contract.
        self.timed(Timed::Kernel(module, func), || {
            check(
                unsafe {
                    (self.lib.cuLaunchKernel)(
                        f,
                        cfg.grid.0,
                        cfg.grid.1,
                        cfg.grid.2,
                        cfg.block.0,
                        cfg.block.1,
                        cfg.block.2,
                        cfg.shared_bytes,
                        self.stream,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    )
                },
                &format!("cuLaunchKernel({module}::{func})"),
            )
        })
    }

    /// Times `f`'s queued work on the stream with events, in milliseconds.
    pub fn time_ms(&self, f: impl FnOnce() -> Result<(), CudaError>) -> Result<f32, CudaError> {
        self.bind()?;
        let lib = self.lib;
        let (mut a, mut b) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: event handles created, recorded on our stream and destroyed here.
        unsafe {
            check(
                (lib.cuEventCreate)(&mut a, sys::CU_EVENT_DEFAULT),
                "cuEventCreate",
            )?;
            check(
                (lib.cuEventCreate)(&mut b, sys::CU_EVENT_DEFAULT),
                "cuEventCreate",
            )?;
            let out = (|| {
                check((lib.cuEventRecord)(a, self.stream), "cuEventRecord")?;
                f()?;
                check((lib.cuEventRecord)(b, self.stream), "cuEventRecord")?;
                check((lib.cuEventSynchronize)(b), "cuEventSynchronize")?;
                let mut ms = 0f32;
                check(
                    (lib.cuEventElapsedTime)(&mut ms, a, b),
                    "cuEventElapsedTime",
                )?;
                Ok(ms)
            })();
            (lib.cuEventDestroy_v2)(a);
            (lib.cuEventDestroy_v2)(b);
            out
        }
    }
}

impl Drop for Gpu {
    fn drop(&mut self) {
        if self.bind().is_ok() {
            // Timing events not read (a run that stopped with the timeline on).
            let _ = self.take_marks();
            // SAFETY: the stream is ours; the workspace and the cached blocks go back to the
            // driver (no buffer is live: each holds an `Arc` of this `Gpu`).
            unsafe {
                let side = std::mem::take(
                    &mut *self.side_streams.lock().unwrap_or_else(|e| e.into_inner()),
                );
                for &s in side.iter().chain([&self.comm_stream]) {
                    (self.lib.cuStreamSynchronize)(s);
                }
                (self.lib.cuStreamSynchronize)(self.stream);
                if let Some(b) = self.blas.lock().unwrap_or_else(|e| e.into_inner()).take() {
                    self.alloc.release(b.workspace, super::blas::WORKSPACE);
                }
                self.alloc.release_cached();
                // No lease is live either (each holds an `Arc` of this `Gpu`).
                let scratch = std::mem::take(
                    &mut *self.host_scratch.lock().unwrap_or_else(|e| e.into_inner()),
                );
                for (p, _) in scratch {
                    super::pinned::free_host(self, p as *mut std::ffi::c_void);
                }
                (self.lib.cuStreamDestroy_v2)(self.stream);
                for s in side.into_iter().chain([self.comm_stream]) {
                    (self.lib.cuStreamDestroy_v2)(s);
                }
            }
        }
    }
}

/// The streams of a [`Gpu`]: kernels and copies, communication, and the side streams made
/// with [`Gpu::side_stream`] (by index).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stream {
    Compute,
    Comm,
    Side(usize),
}

/// A point in a stream's queue ([`Gpu::record`]): other streams wait for it
/// ([`Gpu::wait_for`]), the host asks whether it passed ([`Event::is_done`]).
pub struct Event {
    ev: sys::CUevent,
    gpu: Arc<Gpu>,
}

// SAFETY: an event handle may be used from any thread once the context is current there.
unsafe impl Send for Event {}
unsafe impl Sync for Event {}

impl Event {
    /// Whether the work queued before the event has finished (`cuEventQuery`; the host does
    /// not wait).
    pub fn is_done(&self) -> Result<bool, CudaError> {
        self.gpu.bind()?;
        // SAFETY: a live event of this context.
        match unsafe { (self.gpu.lib.cuEventQuery)(self.ev) } {
            sys::CUDA_ERROR_NOT_READY => Ok(false),
            r => check(r, "cuEventQuery").map(|_| true),
        }
    }

    /// Waits on the host until the event completed.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.gpu.bind()?;
        // SAFETY: a live event of this context.
        check(
            unsafe { (self.gpu.lib.cuEventSynchronize)(self.ev) },
            "cuEventSynchronize",
        )
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: our event; the driver releases it once it completed, even if it is
            // still pending now.
            unsafe { (self.gpu.lib.cuEventDestroy_v2)(self.ev) };
        }
    }
}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Event on cuda:{}", self.gpu.info.ordinal)
    }
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu({:?})", self.info)
    }
}
