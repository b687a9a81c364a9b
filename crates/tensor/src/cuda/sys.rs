//! The NVIDIA libraries xtrain calls, opened at run time (`dlopen`) so that building needs no
//! CUDA toolkit and a machine without a GPU runs everything else: the driver (`libcuda`), NVRTC
//! (`libnvrtc`, kernels compiled from CUDA C), cuBLASLt (`libcublasLt`, the matrix products)
//! and NCCL (`libnccl`, the collectives between GPUs). Each library is a table of function
//! pointers resolved once; a library or symbol that is missing is an error naming it and where
//! it was looked for, never a panic.
//!
//! Where they are looked for, in order: the folders of `XTRAIN_CUDA_LIB_PATH` (`:`-separated),
//! then the system loader's search (`LD_LIBRARY_PATH`, `ldconfig`), then the usual toolkit
//! folders (`$CUDA_HOME/lib64`, `/usr/local/cuda/lib64`). CUDA 13 names are tried before
//! CUDA 12 ones (`libnvrtc.so.13`, `libnvrtc.so.12`, `libnvrtc.so`) except under a CUDA 12
//! driver, which looks for the CUDA 12 NVRTC and cuBLASLt first, so either toolkit (or the
//! pip wheels `nvidia-cuda-nvrtc`, `nvidia-cublas`, whose `lib` folder goes in
//! `XTRAIN_CUDA_LIB_PATH`) serves. The constants below are the values of the CUDA 12 and 13
//! headers (`cuda.h`, `cublasLt.h`, `library_types.h`), which both versions share, and of
//! NCCL 2's `nccl.h` (`libnccl.so.2`, from an NCCL install or the pip wheel `nvidia-nccl-cu12`
//! or `nvidia-nccl-cu13`, whose `nvidia/nccl/lib` folder goes in `XTRAIN_CUDA_LIB_PATH`).
//!
//! (A binding crate such as `cudarc` would supply these tables, but it panics where a library
//! is missing and looks for the library names of the one CUDA version it was built for.)
#![allow(non_camel_case_types, non_snake_case, clippy::upper_case_acronyms)]

use libloading::Library;
use std::ffi::{c_char, c_int, c_uint, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUdeviceptr = u64;
pub type CUcontext = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUevent = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;

pub const CUDA_SUCCESS: CUresult = 0;
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
pub const CUDA_ERROR_NO_DEVICE: CUresult = 100;
pub const CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: c_int = 16;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
pub const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;
pub const CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: c_int = 97;
pub const CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: c_int = 8;
pub const CU_STREAM_NON_BLOCKING: c_uint = 1;
pub const CU_EVENT_DEFAULT: c_uint = 0;
pub const CU_EVENT_DISABLE_TIMING: c_uint = 2;
/// `cuEventQuery`: the work before the event has not finished yet.
pub const CUDA_ERROR_NOT_READY: CUresult = 600;

pub type nvrtcResult = c_int;
pub type nvrtcProgram = *mut c_void;
pub const NVRTC_SUCCESS: nvrtcResult = 0;

pub type cublasStatus_t = c_int;
pub type cublasLtHandle_t = *mut c_void;
pub type cublasLtMatmulDesc_t = *mut c_void;
pub type cublasLtMatrixLayout_t = *mut c_void;
pub type cublasLtMatmulPreference_t = *mut c_void;
pub const CUBLAS_STATUS_SUCCESS: cublasStatus_t = 0;
/// `cublasComputeType_t::CUBLAS_COMPUTE_32F`: fp32 accumulation, no TF32.
pub const CUBLAS_COMPUTE_32F: c_int = 68;
/// `cudaDataType`: fp32, fp16, bf16.
pub const CUDA_R_32F: c_int = 0;
pub const CUDA_R_16F: c_int = 2;
pub const CUDA_R_16BF: c_int = 14;
pub const CUBLASLT_MATMUL_DESC_TRANSA: c_int = 3;
pub const CUBLASLT_MATMUL_DESC_TRANSB: c_int = 4;
pub const CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: c_int = 1;
/// The split-K reduction schemes the heuristic may choose (`uint32_t` mask of
/// `cublasLtReductionScheme_t`; algorithms without split-K always pass).
pub const CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK: c_int = 3;
/// `cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE`: the partial sums added
/// up in the compute type (fp32) in the workspace, then rounded to `C`'s type once.
pub const CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE: u32 = 2;
/// Minimum alignments (bytes, `uint32_t`) of the operands the heuristic may assume; the
/// default is 256, so an algorithm chosen without them may fault on a less aligned pointer.
pub const CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: c_int = 5;
pub const CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: c_int = 6;
pub const CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: c_int = 7;
pub const CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: c_int = 8;
pub const CUBLAS_OP_N: c_int = 0;
pub const CUBLAS_OP_T: c_int = 1;

/// `cublasLtMatmulAlgo_t`: an opaque algorithm description.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct cublasLtMatmulAlgo_t {
    pub data: [u64; 8],
}

/// `cublasLtMatmulHeuristicResult_t`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct cublasLtMatmulHeuristicResult_t {
    pub algo: cublasLtMatmulAlgo_t,
    pub workspaceSize: usize,
    pub state: cublasStatus_t,
    pub wavesCount: f32,
    pub reserved: [c_int; 4],
}

pub type ncclResult_t = c_int;
pub type ncclComm_t = *mut c_void;
pub type ncclDataType_t = c_int;
pub type ncclRedOp_t = c_int;

/// `ncclResult_t` (nccl.h).
pub const NCCL_SUCCESS: ncclResult_t = 0;
pub const NCCL_UNHANDLED_CUDA_ERROR: ncclResult_t = 1;
pub const NCCL_SYSTEM_ERROR: ncclResult_t = 2;
pub const NCCL_INTERNAL_ERROR: ncclResult_t = 3;
pub const NCCL_INVALID_ARGUMENT: ncclResult_t = 4;
pub const NCCL_INVALID_USAGE: ncclResult_t = 5;
pub const NCCL_REMOTE_ERROR: ncclResult_t = 6;
pub const NCCL_IN_PROGRESS: ncclResult_t = 7;
/// `ncclDataType_t`: fp16 (`ncclHalf`), fp32 (`ncclFloat`), bf16.
pub const NCCL_FLOAT16: ncclDataType_t = 6;
pub const NCCL_FLOAT32: ncclDataType_t = 7;
pub const NCCL_BFLOAT16: ncclDataType_t = 9;
/// `ncclRedOp_t`.
pub const NCCL_SUM: ncclRedOp_t = 0;
pub const NCCL_PROD: ncclRedOp_t = 1;
pub const NCCL_MAX: ncclRedOp_t = 2;
pub const NCCL_MIN: ncclRedOp_t = 3;
pub const NCCL_AVG: ncclRedOp_t = 4;
/// Bytes of an `ncclUniqueId`.
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`: the opaque bytes every rank of a communicator is given (passed by value).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    pub internal: [u8; NCCL_UNIQUE_ID_BYTES],
}

/// Declares a table of functions resolved from one library.
macro_rules! api {
    ($table:ident, $what:literal { $( $name:ident : fn($($arg:ty),*) -> $ret:ty; )* }) => {
        pub struct $table {
            /// The file the table was resolved from.
            pub path: String,
            _lib: Library,
            $( pub $name: unsafe extern "C" fn($($arg),*) -> $ret, )*
        }

        impl $table {
            /// Resolves every symbol of the table from `lib`.
            ///
            /// # Safety
            /// `lib` must be the library the signatures were written for.
            unsafe fn resolve(lib: Library, path: String) -> Result<Self, String> {
                $(
                    let $name = *lib
                        .get::<unsafe extern "C" fn($($arg),*) -> $ret>(
                            concat!(stringify!($name), "\0").as_bytes(),
                        )
                        .map_err(|e| {
                            format!("{} ({path}) lacks {}: {e}", $what, stringify!($name))
                        })?;
                )*
                Ok(Self { path, _lib: lib, $($name),* })
            }
        }
    };
}

api!(Driver, "the CUDA driver library" {
    cuInit: fn(c_uint) -> CUresult;
    cuDriverGetVersion: fn(*mut c_int) -> CUresult;
    cuGetErrorName: fn(CUresult, *mut *const c_char) -> CUresult;
    cuGetErrorString: fn(CUresult, *mut *const c_char) -> CUresult;
    cuDeviceGetCount: fn(*mut c_int) -> CUresult;
    cuDeviceGet: fn(*mut CUdevice, c_int) -> CUresult;
    cuDeviceGetName: fn(*mut c_char, c_int, CUdevice) -> CUresult;
    cuDeviceGetAttribute: fn(*mut c_int, c_int, CUdevice) -> CUresult;
    cuDeviceTotalMem_v2: fn(*mut usize, CUdevice) -> CUresult;
    cuDevicePrimaryCtxRetain: fn(*mut CUcontext, CUdevice) -> CUresult;
    cuCtxSetCurrent: fn(CUcontext) -> CUresult;
    cuCtxSynchronize: fn() -> CUresult;
    cuMemAlloc_v2: fn(*mut CUdeviceptr, usize) -> CUresult;
    cuMemFree_v2: fn(CUdeviceptr) -> CUresult;
    cuMemAllocHost_v2: fn(*mut *mut c_void, usize) -> CUresult;
    cuMemFreeHost: fn(*mut c_void) -> CUresult;
    cuMemGetInfo_v2: fn(*mut usize, *mut usize) -> CUresult;
    cuMemcpyHtoDAsync_v2: fn(CUdeviceptr, *const c_void, usize, CUstream) -> CUresult;
    cuMemcpyDtoHAsync_v2: fn(*mut c_void, CUdeviceptr, usize, CUstream) -> CUresult;
    cuMemcpyDtoDAsync_v2: fn(CUdeviceptr, CUdeviceptr, usize, CUstream) -> CUresult;
    cuMemsetD8Async: fn(CUdeviceptr, u8, usize, CUstream) -> CUresult;
    cuStreamCreate: fn(*mut CUstream, c_uint) -> CUresult;
    cuStreamDestroy_v2: fn(CUstream) -> CUresult;
    cuStreamSynchronize: fn(CUstream) -> CUresult;
    cuStreamQuery: fn(CUstream) -> CUresult;
    cuStreamWaitEvent: fn(CUstream, CUevent, c_uint) -> CUresult;
    cuEventCreate: fn(*mut CUevent, c_uint) -> CUresult;
    cuEventDestroy_v2: fn(CUevent) -> CUresult;
    cuEventRecord: fn(CUevent, CUstream) -> CUresult;
    cuEventSynchronize: fn(CUevent) -> CUresult;
    cuEventQuery: fn(CUevent) -> CUresult;
    cuEventElapsedTime: fn(*mut f32, CUevent, CUevent) -> CUresult;
    cuModuleLoadData: fn(*mut CUmodule, *const c_void) -> CUresult;
    cuModuleGetFunction: fn(*mut CUfunction, CUmodule, *const c_char) -> CUresult;
    cuFuncSetAttribute: fn(CUfunction, c_int, c_int) -> CUresult;
    cuLaunchKernel: fn(
        CUfunction, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, CUstream,
        *mut *mut c_void, *mut *mut c_void
    ) -> CUresult;
});

api!(Nvrtc, "the NVRTC library" {
    nvrtcVersion: fn(*mut c_int, *mut c_int) -> nvrtcResult;
    nvrtcGetErrorString: fn(nvrtcResult) -> *const c_char;
    nvrtcCreateProgram: fn(
        *mut nvrtcProgram, *const c_char, *const c_char, c_int, *const *const c_char,
        *const *const c_char
    ) -> nvrtcResult;
    nvrtcCompileProgram: fn(nvrtcProgram, c_int, *const *const c_char) -> nvrtcResult;
    nvrtcGetProgramLogSize: fn(nvrtcProgram, *mut usize) -> nvrtcResult;
    nvrtcGetProgramLog: fn(nvrtcProgram, *mut c_char) -> nvrtcResult;
    nvrtcGetCUBINSize: fn(nvrtcProgram, *mut usize) -> nvrtcResult;
    nvrtcGetCUBIN: fn(nvrtcProgram, *mut c_char) -> nvrtcResult;
    nvrtcDestroyProgram: fn(*mut nvrtcProgram) -> nvrtcResult;
});

api!(BlasLt, "the cuBLASLt library" {
    cublasLtCreate: fn(*mut cublasLtHandle_t) -> cublasStatus_t;
    cublasLtDestroy: fn(cublasLtHandle_t) -> cublasStatus_t;
    cublasLtMatmulDescCreate: fn(*mut cublasLtMatmulDesc_t, c_int, c_int) -> cublasStatus_t;
    cublasLtMatmulDescDestroy: fn(cublasLtMatmulDesc_t) -> cublasStatus_t;
    cublasLtMatmulDescSetAttribute: fn(
        cublasLtMatmulDesc_t, c_int, *const c_void, usize
    ) -> cublasStatus_t;
    cublasLtMatrixLayoutCreate: fn(
        *mut cublasLtMatrixLayout_t, c_int, u64, u64, i64
    ) -> cublasStatus_t;
    cublasLtMatrixLayoutDestroy: fn(cublasLtMatrixLayout_t) -> cublasStatus_t;
    cublasLtMatmulPreferenceCreate: fn(*mut cublasLtMatmulPreference_t) -> cublasStatus_t;
    cublasLtMatmulPreferenceDestroy: fn(cublasLtMatmulPreference_t) -> cublasStatus_t;
    cublasLtMatmulPreferenceSetAttribute: fn(
        cublasLtMatmulPreference_t, c_int, *const c_void, usize
    ) -> cublasStatus_t;
    cublasLtMatmulAlgoGetHeuristic: fn(
        cublasLtHandle_t, cublasLtMatmulDesc_t, cublasLtMatrixLayout_t, cublasLtMatrixLayout_t,
        cublasLtMatrixLayout_t, cublasLtMatrixLayout_t, cublasLtMatmulPreference_t, c_int,
        *mut cublasLtMatmulHeuristicResult_t, *mut c_int
    ) -> cublasStatus_t;
    cublasLtMatmul: fn(
        cublasLtHandle_t, cublasLtMatmulDesc_t, *const c_void, *const c_void,
        cublasLtMatrixLayout_t, *const c_void, cublasLtMatrixLayout_t, *const c_void,
        *const c_void, cublasLtMatrixLayout_t, *mut c_void, cublasLtMatrixLayout_t,
        *const cublasLtMatmulAlgo_t, *mut c_void, usize, CUstream
    ) -> cublasStatus_t;
});

api!(Nccl, "the NCCL library" {
    ncclGetVersion: fn(*mut c_int) -> ncclResult_t;
    ncclGetUniqueId: fn(*mut ncclUniqueId) -> ncclResult_t;
    ncclCommInitRank: fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> ncclResult_t;
    ncclCommDestroy: fn(ncclComm_t) -> ncclResult_t;
    ncclCommAbort: fn(ncclComm_t) -> ncclResult_t;
    ncclCommGetAsyncError: fn(ncclComm_t, *mut ncclResult_t) -> ncclResult_t;
    ncclGetErrorString: fn(ncclResult_t) -> *const c_char;
    ncclAllReduce: fn(
        *const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, ncclComm_t, CUstream
    ) -> ncclResult_t;
    ncclReduce: fn(
        *const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, c_int, ncclComm_t,
        CUstream
    ) -> ncclResult_t;
    ncclBroadcast: fn(
        *const c_void, *mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, CUstream
    ) -> ncclResult_t;
    ncclAllGather: fn(
        *const c_void, *mut c_void, usize, ncclDataType_t, ncclComm_t, CUstream
    ) -> ncclResult_t;
    ncclReduceScatter: fn(
        *const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, ncclComm_t, CUstream
    ) -> ncclResult_t;
    ncclSend: fn(*const c_void, usize, ncclDataType_t, c_int, ncclComm_t, CUstream) -> ncclResult_t;
    ncclRecv: fn(*mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, CUstream) -> ncclResult_t;
    ncclGroupStart: fn() -> ncclResult_t;
    ncclGroupEnd: fn() -> ncclResult_t;
});

/// Environment variable: folders (`:`-separated) searched first for the CUDA libraries.
pub const LIB_PATH_ENV: &str = "XTRAIN_CUDA_LIB_PATH";

/// The folders searched before the system loader's own search.
fn first_folders() -> Vec<PathBuf> {
    std::env::var(LIB_PATH_ENV)
        .map(|v| {
            v.split(':')
                .filter(|s| !s.is_empty())
                .map(PathBuf::from)
                .collect()
        })
        .unwrap_or_default()
}

/// The usual toolkit folders, searched after the system loader.
fn toolkit_folders() -> Vec<PathBuf> {
    let mut v = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Ok(home) = std::env::var(var) {
            v.push(PathBuf::from(&home).join("lib64"));
            v.push(PathBuf::from(&home).join("lib"));
        }
    }
    v.push("/usr/local/cuda/lib64".into());
    v.push("/usr/local/cuda/targets/x86_64-linux/lib".into());
    // Where container images mount the driver's libraries.
    v.push("/usr/local/nvidia/lib64".into());
    v
}

/// Opens the first of `names` found in the search order (module doc); the error lists every
/// place tried.
fn open(what: &str, names: &[&str]) -> Result<(Library, String), String> {
    let mut tried = Vec::new();
    let attempt = |spec: &std::ffi::OsStr, tried: &mut Vec<String>| {
        let path = std::path::Path::new(spec);
        if path.is_absolute() && spec.to_string_lossy().contains("libnvrtc.") {
            preload_builtins(path);
        }
        // SAFETY: loading a vendor library runs its initialisers, which is what using it means.
        match unsafe { Library::new(spec) } {
            Ok(lib) => Some(lib),
            Err(e) => {
                tried.push(format!("{} ({e})", spec.to_string_lossy()));
                None
            }
        }
    };
    for dir in first_folders() {
        for n in names {
            let p = dir.join(n);
            if p.exists() {
                if let Some(lib) = attempt(p.as_os_str(), &mut tried) {
                    return Ok((lib, p.display().to_string()));
                }
            }
        }
    }
    for n in names {
        if let Some(lib) = attempt(std::ffi::OsStr::new(n), &mut tried) {
            return Ok((lib, (*n).to_string()));
        }
    }
    for dir in toolkit_folders() {
        for n in names {
            let p = dir.join(n);
            if p.exists() {
                if let Some(lib) = attempt(p.as_os_str(), &mut tried) {
                    return Ok((lib, p.display().to_string()));
                }
            }
        }
    }
    let short: Vec<&str> = tried
        .iter()
        .map(|t| t.split(" (").next().unwrap_or(t))
        .collect();
    let first: Vec<String> = first_folders()
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    let first = if first.is_empty() {
        format!("{LIB_PATH_ENV} (unset)")
    } else {
        format!("{LIB_PATH_ENV} ({})", first.join(", "))
    };
    let toolkit: Vec<String> = toolkit_folders()
        .iter()
        .map(|d| d.display().to_string())
        .collect();
    Err(format!(
        "{what} was not found (looked in {first}, the system loader's path, {}; tried {}); \
         install it or name its folder in {LIB_PATH_ENV}",
        toolkit.join(", "),
        short.join(", ")
    ))
}

/// The driver library, opened once per process.
pub fn driver() -> Result<&'static Driver, String> {
    static LIB: OnceLock<Result<Driver, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let (lib, path) = open(
            "the NVIDIA driver (libcuda.so.1; no NVIDIA driver is installed on this machine?)",
            &["libcuda.so.1", "libcuda.so"],
        )?;
        // SAFETY: the signatures are those of cuda.h (CUDA 12 and 13).
        unsafe { Driver::resolve(lib, path) }
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Whether the machine's driver is a CUDA 12 one (`cuDriverGetVersion` in 12000..13000; it
/// needs no `cuInit`). Such a driver cannot load the cubins a CUDA 13 NVRTC makes nor run a
/// CUDA 13 cuBLASLt, so their CUDA 12 libraries are looked for first there.
fn driver_is_cuda12() -> bool {
    let Ok(d) = driver() else { return false };
    let mut v = 0;
    // SAFETY: a valid out-pointer.
    let r = unsafe { (d.cuDriverGetVersion)(&mut v) };
    r == CUDA_SUCCESS && (12000..13000).contains(&v)
}

/// [`open`] of `names`, trying `cuda12` alone first under a CUDA 12 driver
/// ([`driver_is_cuda12`]), wherever a CUDA 13 library would otherwise be found first.
fn open_for_driver(what: &str, cuda12: &str, names: &[&str]) -> Result<(Library, String), String> {
    if driver_is_cuda12() {
        if let Ok(found) = open(what, &[cuda12]) {
            return Ok(found);
        }
    }
    open(what, names)
}

/// NVRTC, opened once per process.
pub fn nvrtc() -> Result<&'static Nvrtc, String> {
    static LIB: OnceLock<Result<Nvrtc, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let (lib, path) = open_for_driver(
            "NVRTC (libnvrtc.so.13 or .12, from a CUDA toolkit or the pip wheel nvidia-cuda-nvrtc)",
            "libnvrtc.so.12",
            &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
        )?;
        // SAFETY: the signatures are those of nvrtc.h (CUDA 12 and 13).
        unsafe { Nvrtc::resolve(lib, path) }
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// Loads the NVRTC builtins library beside `nvrtc` (same folder) first, by its path, so that
/// NVRTC's own `dlopen("libnvrtc-builtins.so.M.m")` finds it already loaded even when the folder
/// is not on the loader's search path (pip wheels: some NVRTC releases carry no `$ORIGIN`
/// run path). Loaded for the life of the process, as NVRTC itself would.
fn preload_builtins(nvrtc: &std::path::Path) {
    let Some(dir) = nvrtc.parent() else { return };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.starts_with("libnvrtc-builtins.so") {
            // SAFETY: the vendor's helper library; loading runs its initialisers only.
            if let Ok(lib) = unsafe {
                libloading::os::unix::Library::open(
                    Some(e.path()),
                    libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
                )
            } {
                std::mem::forget(lib);
            }
        }
    }
}

/// The NVRTC library of folder `dir` (its `libnvrtc.so.13` or `.12`), opened apart from the
/// process's own ([`nvrtc`]): the kernel check compiles with every NVRTC it is given.
pub fn nvrtc_in(dir: &std::path::Path) -> Result<Nvrtc, String> {
    for name in ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"] {
        let p = dir.join(name);
        if p.exists() {
            preload_builtins(&p);
            // SAFETY: loading NVRTC runs its initialisers; the signatures are nvrtc.h's.
            let lib = unsafe { Library::new(&p) }.map_err(|e| format!("{}: {e}", p.display()))?;
            return unsafe { Nvrtc::resolve(lib, p.display().to_string()) };
        }
    }
    Err(format!("no libnvrtc in {}", dir.display()))
}

/// The folders of `XTRAIN_CUDA_LIB_PATH` that hold an NVRTC library.
pub fn nvrtc_folders() -> Vec<PathBuf> {
    first_folders()
        .into_iter()
        .filter(|d| {
            ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
                .iter()
                .any(|n| d.join(n).exists())
        })
        .collect()
}

/// cuBLASLt, opened once per process.
pub fn blaslt() -> Result<&'static BlasLt, String> {
    static LIB: OnceLock<Result<BlasLt, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let (lib, path) = open_for_driver(
            "cuBLASLt (libcublasLt.so.13 or .12, from a CUDA toolkit or the pip wheel nvidia-cublas)",
            "libcublasLt.so.12",
            &["libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"],
        )?;
        // SAFETY: the signatures are those of cublasLt.h (CUDA 12 and 13).
        unsafe { BlasLt::resolve(lib, path) }
    })
    .as_ref()
    .map_err(Clone::clone)
}

/// NCCL, opened once per process. The error says what to install, or how to go on without it.
pub fn nccl() -> Result<&'static Nccl, String> {
    static LIB: OnceLock<Result<Nccl, String>> = OnceLock::new();
    LIB.get_or_init(|| {
        let (lib, path) =
            open("NCCL (libnccl.so.2)", &["libnccl.so.2", "libnccl.so"]).map_err(|e| {
                format!(
                    "{e}: NCCL 2 comes with the pip wheel nvidia-nccl-cu12 or nvidia-nccl-cu13 \
                     (its nvidia/nccl/lib folder goes in {LIB_PATH_ENV}) or an NCCL package; \
                     without it, the own host-staged collectives serve (XTRAIN_BACKEND=own)"
                )
            })?;
        // SAFETY: the signatures are those of NCCL 2's nccl.h.
        unsafe { Nccl::resolve(lib, path) }
    })
    .as_ref()
    .map_err(Clone::clone)
}
