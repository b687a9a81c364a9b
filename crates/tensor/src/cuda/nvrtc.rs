//! CUDA C → cubin at run time with NVRTC, for the GPU found (`sm_XY` from its compute
//! capability), cached on disk so a second run loads the cubin without compiling.
//!
//! The cache lives in `XTRAIN_KERNEL_CACHE`, else `$XDG_CACHE_HOME/xtrain/kernels`, else
//! `~/.cache/xtrain/kernels`; each entry is named by a hash of the source, the options, the
//! architecture and NVRTC's version, and is written atomically (a temporary file renamed into
//! place), so concurrent ranks compiling the same kernel never read half a file. A cache that
//! cannot be written is not an error: the kernel is just compiled again next time.
//!
//! Kernels are compiled without fast-math (the exponentials and divisions of attention,
//! softmax and the norms must match the CPU kernels to fp32 rounding) and must compile
//! without a single warning ([`compile`] returns the log with the cubin; the kernel tests
//! fail on a non-empty log).

use super::sys;
use super::CudaError;
use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

/// Environment variable naming the kernel cache folder.
pub const CACHE_ENV: &str = "XTRAIN_KERNEL_CACHE";

/// A compiled kernel module.
pub struct Compiled {
    pub cubin: Vec<u8>,
    /// The compiler's log (warnings; empty for a clean compile).
    pub log: String,
    /// Whether the cubin came from the disk cache.
    pub cached: bool,
}

/// NVRTC's version `(major, minor)`.
pub fn version() -> Result<(i32, i32), CudaError> {
    version_of(sys::nvrtc().map_err(CudaError::Library)?)
}

/// The version of a given NVRTC library.
pub fn version_of(lib: &sys::Nvrtc) -> Result<(i32, i32), CudaError> {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: two valid out-pointers.
    let r = unsafe { (lib.nvrtcVersion)(&mut major, &mut minor) };
    check(lib, r, "nvrtcVersion")?;
    Ok((major, minor))
}

/// The options every kernel is compiled with for `sm_{arch}`.
pub fn options(arch: u32) -> Vec<String> {
    vec![
        format!("--gpu-architecture=sm_{arch}"),
        "--std=c++17".into(),
        "--device-as-default-execution-space".into(),
        // Keep IEEE division and square root and denormals: parity with the CPU kernels.
        "--fmad=true".into(),
    ]
}

/// Compiles `source` (named `name` in messages) for `sm_{arch}`, or loads it from the cache.
pub fn compile(name: &str, source: &str, arch: u32) -> Result<Compiled, CudaError> {
    let opts = options(arch);
    let (major, minor) = version()?;
    let key = cache_key(source, &opts, major, minor);
    let path = cache_dir().map(|d| d.join(format!("{name}-sm{arch}-{key:016x}.cubin")));
    if let Some(p) = &path {
        if let Ok(cubin) = std::fs::read(p) {
            if !cubin.is_empty() {
                return Ok(Compiled {
                    cubin,
                    log: String::new(),
                    cached: true,
                });
            }
        }
    }
    let compiled = compile_fresh(name, source, arch)?;
    if let Some(p) = &path {
        store(p, &compiled.cubin);
    }
    Ok(compiled)
}

/// Compiles `source` for `sm_{arch}` without the cache (what the kernel check runs: it needs
/// the compiler's log).
pub fn compile_fresh(name: &str, source: &str, arch: u32) -> Result<Compiled, CudaError> {
    compile_with(
        sys::nvrtc().map_err(CudaError::Library)?,
        name,
        source,
        arch,
    )
}

/// [`compile_fresh`] with a given NVRTC library.
pub fn compile_with(
    lib: &sys::Nvrtc,
    name: &str,
    source: &str,
    arch: u32,
) -> Result<Compiled, CudaError> {
    let opts = options(arch);
    let src = CString::new(source)
        .map_err(|_| CudaError::Compile(format!("{name}: the source holds a NUL byte")))?;
    let cname = CString::new(format!("{name}.cu")).expect("kernel names have no NUL");
    let copts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).expect("options have no NUL"))
        .collect();
    let ptrs: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings; no headers are passed.
    let r = unsafe {
        (lib.nvrtcCreateProgram)(
            &mut prog,
            src.as_ptr(),
            cname.as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    check(lib, r, "nvrtcCreateProgram")?;
    let result = (|| {
        // SAFETY: `prog` was created above; the option pointers outlive the call.
        let r = unsafe { (lib.nvrtcCompileProgram)(prog, ptrs.len() as i32, ptrs.as_ptr()) };
        let log = program_log(lib, prog)?;
        if r != sys::NVRTC_SUCCESS {
            return Err(CudaError::Compile(format!(
                "{name}.cu did not compile ({}):\n{log}",
                error_string(lib, r)
            )));
        }
        let mut size = 0usize;
        // SAFETY: `prog` compiled; out-pointer valid.
        check(
            lib,
            unsafe { (lib.nvrtcGetCUBINSize)(prog, &mut size) },
            "nvrtcGetCUBINSize",
        )?;
        let mut cubin = vec![0u8; size];
        // SAFETY: `cubin` holds `size` bytes as NVRTC asked.
        check(
            lib,
            unsafe { (lib.nvrtcGetCUBIN)(prog, cubin.as_mut_ptr() as *mut c_char) },
            "nvrtcGetCUBIN",
        )?;
        Ok(Compiled {
            cubin,
            log,
            cached: false,
        })
    })();
    // SAFETY: destroys the program created above, once.
    unsafe { (lib.nvrtcDestroyProgram)(&mut prog) };
    result
}

/// The program's log, without the trailing NUL and blank lines.
fn program_log(lib: &sys::Nvrtc, prog: sys::nvrtcProgram) -> Result<String, CudaError> {
    let mut size = 0usize;
    // SAFETY: valid program and out-pointer.
    check(
        lib,
        unsafe { (lib.nvrtcGetProgramLogSize)(prog, &mut size) },
        "nvrtcGetProgramLogSize",
    )?;
    let mut buf = vec![0u8; size.max(1)];
    // SAFETY: `buf` holds `size` bytes.
    check(
        lib,
        unsafe { (lib.nvrtcGetProgramLog)(prog, buf.as_mut_ptr() as *mut c_char) },
        "nvrtcGetProgramLog",
    )?;
    let text = String::from_utf8_lossy(&buf);
    Ok(text
        .trim_matches(|c: char| c == '\0' || c.is_whitespace())
        .to_string())
}

fn error_string(lib: &sys::Nvrtc, r: sys::nvrtcResult) -> String {
    // SAFETY: nvrtcGetErrorString returns a static C string for any code.
    unsafe {
        let p = (lib.nvrtcGetErrorString)(r);
        if p.is_null() {
            format!("NVRTC error {r}")
        } else {
            CStr::from_ptr(p).to_string_lossy().into_owned()
        }
    }
}

fn check(lib: &sys::Nvrtc, r: sys::nvrtcResult, call: &str) -> Result<(), CudaError> {
    if r == sys::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Compile(format!(
            "{call}: {}",
            error_string(lib, r)
        )))
    }
}

/// FNV-1a over the inputs that decide the cubin.
fn cache_key(source: &str, opts: &[String], major: i32, minor: i32) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let mut eat = |bytes: &[u8]| {
        for &b in bytes {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0100_0000_01b3);
    };
    eat(source.as_bytes());
    for o in opts {
        eat(o.as_bytes());
    }
    eat(&major.to_le_bytes());
    eat(&minor.to_le_bytes());
    h
}

/// The cache folder (module doc), or `None` when no home is known.
fn cache_dir() -> Option<PathBuf> {
    if let Ok(d) = std::env::var(CACHE_ENV) {
        return (!d.is_empty()).then(|| PathBuf::from(d));
    }
    if let Ok(d) = std::env::var("XDG_CACHE_HOME") {
        if !d.is_empty() {
            return Some(PathBuf::from(d).join("xtrain/kernels"));
        }
    }
    std::env::var("HOME")
        .ok()
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(".cache/xtrain/kernels"))
}

/// Writes `bytes` to `path` atomically; failures only cost a later recompile.
fn store(path: &std::path::Path, bytes: &[u8]) {
    let Some(dir) = path.parent() else { return };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("k"),
        std::process::id()
    ));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}
