//! Every CUDA kernel module compiles with NVRTC, for sm_80
//! (A100) and sm_90 (H100/H200), without a single warning, and every kernel the launchers name
//! is an entry of one of them, so a kernel that does not compile, or a launch of a kernel that
//! does not exist, never lands. Needs NVRTC only (no GPU, no driver): CI installs CUDA 12's and CUDA 13's from the pip wheels
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
    // The first compiler's sm_90 cubins, for the kernel names below.
    let cubins = std::sync::Mutex::new(Vec::<(String, Vec<u8>)>::new());
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
                        let what =
                            format!("NVRTC {major}.{minor} ({}), {module} sm_{arch}", lib.path);
                        match nvrtc::compile_with(lib, module, &source, arch) {
                            Ok(c) if c.log.is_empty() && !c.cubin.is_empty() => {
                                if std::ptr::eq(lib, all[0]) && arch == 90 {
                                    cubins.lock().unwrap().push((module.to_string(), c.cubin));
                                }
                            }
                            Ok(c) => failed.push(format!("{what}: warnings:\n{}", c.log)),
                            Err(e) => failed.push(format!("{what}: {e}")),
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
    launched_kernels_are_compiled(&cubins.into_inner().unwrap());
}

/// Every kernel name the launchers (`cuda/ops.rs`) write is an entry of a compiled module, so
/// that a misspelt or missing kernel fails here rather than on the first GPU to run it: each
/// snake_case string literal of the launchers' source is a kernel entry (a `\0name\0` symbol
/// of a module's cubin), a module's name, or one of the few other words listed here.
fn launched_kernels_are_compiled(cubins: &[(String, Vec<u8>)]) {
    // Not kernels: the tensor-core attention's kernel families (`tc_kernel` picks the entry)
    // and argument names in error messages.
    const OTHER: [&str; 12] = [
        "attn_fwd_tc",
        "attn_bwd_dq_tc",
        "attn_bwd_dkv_tc",
        "attn_bwd_fused_tc",
        "head_dim",
        "k_start",
        "kv_len",
        "n_heads",
        "n_kv_heads",
        "q_len",
        "q_start",
        "vocab_start",
    ];
    assert_eq!(
        cubins.len(),
        kernels::SOURCES.len(),
        "a cubin of every module"
    );
    let source = include_str!("../src/cuda/ops.rs");
    let snake = |w: &str| {
        w.starts_with(|c: char| c.is_ascii_lowercase())
            && w.contains('_')
            && w.chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
    };
    let literals: Vec<&str> = source
        .split('"')
        .skip(1)
        .step_by(2)
        .filter(|w| snake(w))
        .collect();
    // The scan keeps in step with the quotes, from the file's first kernels to its last.
    for name in [
        "cast_f32_bf16",
        "swiglu_forward",
        "scatter_add_rows",
        "row_dots",
    ] {
        assert!(literals.contains(&name), "the scan finds {name}");
    }
    let entry = |name: &str| {
        let symbol = [&[0u8][..], name.as_bytes(), &[0u8]].concat();
        cubins
            .iter()
            .any(|(_, c)| c.windows(symbol.len()).any(|w| w == symbol.as_slice()))
    };
    let missing: Vec<&str> = literals
        .into_iter()
        .filter(|w| !OTHER.contains(w) && !kernels::SOURCES.iter().any(|(m, _)| m == w))
        .filter(|w| !entry(w))
        .collect();
    assert!(missing.is_empty(), "launched but not compiled: {missing:?}");
    assert!(!entry("no_such_kernel_name"), "the symbol search can fail");
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
