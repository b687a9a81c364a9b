//! The kernels under `dev/` (candidates measured against the library's before they replace
//! them, e.g. `dev/attention/attention_tc_next.cu` by `examples/attention_next.rs`) compile
//! with NVRTC as the library's kernel modules do (the prelude in front, the library's options),
//! for sm_80 and sm_90, without a single warning, so a candidate that no longer compiles is
//! seen before someone takes it to a GPU. NVRTC as in `cuda_kernels_compile.rs`: every one
//! found in the folders of `XTRAIN_CUDA_LIB_PATH` (CI: CUDA 12's and 13's), else the one the
//! process would load; none is a SKIPPED line (a failure where `XTRAIN_REQUIRE` lists `nvrtc`).
use tensor::cuda::{kernels, nvrtc, sys};

/// `(module, source without the prelude)` of every kernel under `dev/`.
const DEV_SOURCES: &[(&str, &str)] = &[(
    "attention_tc_next",
    include_str!("../../../dev/attention/attention_tc_next.cu"),
)];

#[test]
fn every_dev_kernel_compiles_for_sm80_and_sm90_without_warnings() {
    let mut libs = Vec::new();
    for dir in sys::nvrtc_folders() {
        match sys::nvrtc_in(&dir) {
            Ok(lib) => libs.push(lib),
            Err(e) => panic!("{e}"),
        }
    }
    let default;
    let mut all: Vec<&sys::Nvrtc> = libs.iter().collect();
    if all.is_empty() {
        default = match sys::nvrtc() {
            Ok(l) => l,
            Err(e) => return tensor::skip::skip("dev CUDA kernel compile check", "nvrtc", &e),
        };
        all.push(default);
    }
    let mut failures = Vec::new();
    for lib in all {
        let (major, minor) = nvrtc::version_of(lib).unwrap();
        for (module, src) in DEV_SOURCES {
            // As `kernels::source` builds a library module.
            let source = format!("{}\n#line 1 \"{module}.cu\"\n{src}", kernels::PRELUDE);
            for arch in [80, 90] {
                match nvrtc::compile_with(lib, module, &source, arch) {
                    Ok(c) if c.log.is_empty() && !c.cubin.is_empty() => {}
                    Ok(c) => failures.push(format!(
                        "NVRTC {major}.{minor} ({}), {module} sm_{arch}: warnings:\n{}",
                        lib.path, c.log
                    )),
                    Err(e) => failures.push(format!(
                        "NVRTC {major}.{minor} ({}), {module} sm_{arch}: {e}",
                        lib.path
                    )),
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
