//! NCCL is opened at run time: where it is missing, asking for it is an error that names
//! `libnccl`, where it was looked for and what to do; where a system NCCL exists, it loads.
//! (Its own test binary: the test sets `XTRAIN_CUDA_LIB_PATH` for the process before NCCL is
//! first looked for, and no other test shares the process.)
use tensor::cuda::{nccl, CudaError, NcclId};

#[test]
fn nccl_loads_or_its_absence_says_what_to_do() {
    // An empty folder first in the search: only an NCCL the system loader or a toolkit
    // folder provides can be found.
    let dir = std::env::temp_dir().join(format!("xtrain-nccl-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::env::set_var("XTRAIN_CUDA_LIB_PATH", &dir);
    let version = nccl::nccl_version();
    let id = NcclId::new();
    std::fs::remove_dir_all(&dir).ok();
    match version {
        Err(CudaError::Library(m)) => {
            eprintln!("no NCCL here, as expected: {m}");
            for needle in [
                "libnccl",
                &dir.display().to_string(),
                "XTRAIN_CUDA_LIB_PATH",
                "the system loader",
                "nvidia-nccl-cu12",
                "nvidia-nccl-cu13",
                "XTRAIN_BACKEND=own",
            ] {
                assert!(m.contains(needle), "the error lacks {needle:?}: {m}");
            }
            // Every entry point gives the same error, never a panic.
            assert_eq!(id.err(), Some(CudaError::Library(m.clone())));
            assert_eq!(nccl::nccl_library_path().err(), Some(CudaError::Library(m)));
        }
        Ok(v) => {
            let path = nccl::nccl_library_path().unwrap();
            eprintln!("NCCL {}.{}.{} found at {path}", v.0, v.1, v.2);
            assert!(v.0 >= 2, "NCCL {v:?} at {path}");
            assert!(path.contains("libnccl"), "{path}");
            assert!(
                !path.starts_with(&dir.display().to_string()),
                "{path} in an empty folder"
            );
        }
        Err(other) => panic!("not a library error: {other:?}"),
    }
}
