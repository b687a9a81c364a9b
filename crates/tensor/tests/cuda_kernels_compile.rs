//! Every CUDA kernel module compiles with NVRTC, for sm_80
//! (A100) and sm_90 (H100/H200), without a single warning, so a kernel that does not compile
//! never lands. Needs NVRTC only (no GPU, no driver): CI installs CUDA 12's and CUDA 13's from the pip wheels
//! `nvidia-cuda-nvrtc-cu12` and `nvidia-cuda-nvrtc` and names their folders in
//! `XTRAIN_CUDA_LIB_PATH`; every NVRTC found there compiles every kernel. Without NVRTC the
//! test says SKIPPED (a failure where `XTRAIN_REQUIRE` lists `nvrtc`, as CI's does).
use tensor::cuda::{kernels, nvrtc, sys};

/// The NVRTC libraries to check with: each folder of `XTRAIN_CUDA_LIB_PATH` that holds one
/// (CI gives a CUDA 12 and a CUDA 13 one), else the one the process would load.
fn compilers() -> Vec<(String, sys::Nvrtc)> {
    let mut libs = Vec::new();
    for dir in sys::nvrtc_folders() {
        match sys::nvrtc_in(&dir) {
            Ok(lib) => libs.push((dir.display().to_string(), lib)),
            Err(e) => panic!("{e}"),
        }
    }
    libs
}

#[test]
fn every_kernel_compiles_for_sm80_and_sm90_without_warnings() {
    let mut libs = compilers();
    let default;
    let mut all: Vec<&sys::Nvrtc> = libs.iter_mut().map(|(_, l)| &*l).collect();
    if all.is_empty() {
        default = match sys::nvrtc() {
            Ok(l) => l,
            Err(e) => return tensor::skip::skip("CUDA kernel compile check", "nvrtc", &e),
        };
        all.push(default);
    }
    // Every (compiler, module, architecture) on the cores there are: NVRTC compiles
    // independent programs concurrently, and the check is CI's longest after the MPI test.
    let jobs: Vec<(&sys::Nvrtc, &str, u32)> = all
        .iter()
        .flat_map(|&lib| {
            kernels::SOURCES
                .iter()
                .flat_map(move |(module, _)| [80, 90].map(|arch| (lib, *module, arch)))
        })
        .collect();
    let next = std::sync::atomic::AtomicUsize::new(0);
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let failures: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads.min(jobs.len()))
            .map(|_| {
                s.spawn(|| {
                    let mut failed = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(lib, module, arch)) = jobs.get(i) else {
                            return failed;
                        };
                        let (major, minor) = nvrtc::version_of(lib).unwrap();
                        let source = kernels::source(module).expect("listed module");
                        match nvrtc::compile_with(lib, module, &source, arch) {
                            Ok(c) if c.log.is_empty() && !c.cubin.is_empty() => {}
                            Ok(c) => failed.push(format!(
                                "NVRTC {major}.{minor} ({}), {module} sm_{arch}: warnings:\n{}",
                                lib.path, c.log
                            )),
                            Err(e) => failed.push(format!(
                                "NVRTC {major}.{minor} ({}), {module} sm_{arch}: {e}",
                                lib.path
                            )),
                        }
                    }
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a compile thread panicked"))
            .collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// An unknown module and a source that does not compile are errors carrying the compiler's
/// message, never a panic.
#[test]
fn a_bad_kernel_is_an_error_with_the_compiler_log() {
    if let Err(e) = nvrtc::version() {
        return tensor::skip::skip("CUDA kernel compile errors", "nvrtc", &e.to_string());
    }
    let bad = "extern \"C\" __global__ void k(float* x) { x[0] = undefined_name; }";
    let err = nvrtc::compile_fresh("bad", bad, 80)
        .err()
        .expect("does not compile");
    let text = err.to_string();
    assert!(
        text.contains("bad.cu") && text.contains("undefined_name"),
        "{text}"
    );
    assert!(kernels::source("no_such_module").is_none());
}
