//! The CUDA device: xtrain's kernels on an NVIDIA GPU, beside the CPU kernels that stay the
//! reference (every GPU kernel is tested against its CPU twin on the same inputs).
//!
//! - [`sys`]: the driver, NVRTC, cuBLASLt and NCCL, opened at run time (no toolkit at build
//!   time);
//! - [`driver`]: the [`Gpu`] (context, stream, kernel modules, allocator), [`DevBuf`] and
//!   kernel launches;
//! - [`nvrtc`]: CUDA C → cubin for the GPU found, cached on disk;
//! - [`alloc`]: the caching allocator (no driver allocation in a steady-state step);
//! - [`pinned`]: page-locked host memory ([`Pinned`]) for copies at the link's speed;
//! - [`timeline`]: device time per kernel, product and copy ([`Gpu::kernel_times`]);
//! - [`widening`]: fp32 copies registered with the 16-bit bits they widen, which products
//!   read instead of rounding the copy back;
//! - [`blas`]: matrix products on cuBLASLt (fp32 without TF32, bf16/fp16 inputs with fp32
//!   accumulation), plans cached per shape;
//! - [`kernels`]: the CUDA C sources; [`ops`]: typed launchers with the CPU kernels'
//!   signatures and conventions; [`doc_mask`]: attention's document mask as the kernels read
//!   it;
//! - [`nccl`]: NCCL communicators ([`NcclComm`], [`NcclId`]) and their collectives on device
//!   buffers, ordered on the [`Gpu`]'s compute stream.
//!
//! A machine without a driver or GPU builds and runs everything else; asking for the device
//! there is an error naming what is missing ([`CudaError`]).

pub mod alloc;
pub mod blas;
pub mod doc_mask;
pub mod driver;
pub mod kernels;
pub mod nccl;
pub mod nvrtc;
pub mod ops;
pub mod pinned;
pub mod sys;
pub mod timeline;
pub mod widening;

pub use driver::{
    device_count, DevBuf, DevSlice, DevSliceMut, DeviceInfo, Event, Gpu, KArg, LaunchCfg, Stream,
    Watch,
};
pub use nccl::{NcclBuf, NcclBufMut, NcclComm, NcclId, ReduceOp};
pub use pinned::{HostScratch, Pinned, Staged, Unordered};
pub use timeline::KernelTime;

/// Why a CUDA operation failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CudaError {
    /// A library (driver, NVRTC, cuBLASLt, NCCL) is missing or incomplete.
    #[error("{0}")]
    Library(String),
    /// No usable GPU (none found, driver too old, compute capability too low).
    #[error("{0}")]
    NoDevice(String),
    /// A driver call failed.
    #[error("{call} failed: {message} (CUDA error {code})")]
    Driver {
        call: String,
        code: i32,
        message: String,
    },
    /// An NCCL call failed (`message`: NCCL's `ncclGetErrorString`).
    #[error("{call} failed: {message} (NCCL error {code}; NCCL_DEBUG=WARN prints NCCL's account)")]
    Nccl {
        call: String,
        code: i32,
        message: String,
    },
    /// A kernel did not compile.
    #[error("kernel compilation: {0}")]
    Compile(String),
    /// A cuBLASLt call failed.
    #[error("cuBLASLt: {0}")]
    Blas(String),
    /// The device ran out of memory.
    #[error("out of GPU memory: {0}")]
    OutOfMemory(String),
    /// Buffers of the wrong size for the operation.
    #[error("invalid shape: {0}")]
    Shape(String),
    /// The host waited for the GPU's queued work longer than its watch allows, or the watch's
    /// check found an error ([`Gpu::watch`]): typically a collective whose peer stopped.
    #[error("{0}")]
    Stalled(String),
}

impl From<CudaError> for crate::TensorError {
    fn from(e: CudaError) -> Self {
        crate::TensorError::Device(e.to_string())
    }
}
