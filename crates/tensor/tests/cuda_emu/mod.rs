//! The GPU tests on a CPU emulation of a CUDA device, so that every CUDA kernel runs against
//! its CPU twin on every machine, GPU or not (what the tests check on an emulated device is
//! the kernels' logic, not their speed).
//!
//! `libraries.cpp` stands in for the libraries xtrain opens — the driver, NVRTC, cuBLASLt
//! and NCCL (communicators of one rank) — and `device.h` for what a GPU gives a kernel (threads, barriers, shared memory,
//! warp shuffles, `mma.sync`, `ldmatrix`, `cp.async`): the kernel modules are compiled by the
//! host's C++ compiler after it and run on the CPU (their header comments say how). The
//! library is built here with the host's C++ compiler (`$CXX`, else `c++`) into the test
//! target folder, and a GPU test file reruns its own tests on it in a child process whose
//! `XTRAIN_CUDA_LIB_PATH` names it first: the library code under test is the same, only the
//! libraries it opens differ. Where no C++ compiler is found the rerun prints one `SKIPPED`
//! line (a failure where `XTRAIN_REQUIRE` lists `emu`).

use std::path::{Path, PathBuf};
use std::process::Command;

/// Set in the child process that runs the tests on the emulated device.
pub const CHILD_ENV: &str = "XTRAIN_CUDA_EMU";

const DEVICE_H: &str = include_str!("device.h");
const HALVES_H: &str = include_str!("halves.h");
const LIBRARIES: &str = include_str!("libraries.cpp");

/// The library file and the names xtrain opens it by.
const LIBRARY: &str = "libxtrain_cuda_emu.so";
const NAMES: [&str; 4] = [
    "libcuda.so.1",
    "libnvrtc.so.13",
    "libcublasLt.so.13",
    "libnccl.so.2",
];

/// Whether this process is the child that runs the tests on the emulated device.
pub fn in_child() -> bool {
    std::env::var_os(CHILD_ENV).is_some()
}

/// The host's C++ compiler.
fn compiler() -> String {
    std::env::var("CXX")
        .ok()
        .filter(|c| !c.is_empty())
        .unwrap_or_else(|| "c++".into())
}

/// Builds the emulated libraries (once per source) under `root`; the folder to put in
/// `XTRAIN_CUDA_LIB_PATH`, or why it could not be built.
pub fn build(root: &Path) -> Result<PathBuf, String> {
    if !cfg!(all(target_arch = "x86_64", target_os = "linux")) {
        return Err("the emulated device's threads (device.h) are written for x86-64 Linux".into());
    }
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for b in DEVICE_H
        .bytes()
        .chain(HALVES_H.bytes())
        .chain(LIBRARIES.bytes())
    {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    let dir = root.join(format!("cuda-emu-{h:016x}"));
    if dir.join(LIBRARY).exists() && NAMES.iter().all(|n| dir.join(n).exists()) {
        return Ok(dir);
    }
    let tmp = root.join(format!("cuda-emu-{h:016x}.{}.tmp", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::write(tmp.join("device.h"), DEVICE_H).map_err(|e| e.to_string())?;
    std::fs::write(tmp.join("halves.h"), HALVES_H).map_err(|e| e.to_string())?;
    std::fs::write(tmp.join("libraries.cpp"), LIBRARIES).map_err(|e| e.to_string())?;
    let cxx = compiler();
    let out = Command::new(&cxx)
        .args([
            "-std=c++17",
            "-O3",
            "-march=native",
            "-fPIC",
            "-shared",
            "-Wall",
            "-Werror",
        ])
        .arg(format!(
            "-DXT_EMU_DEVICE_H=\"{}\"",
            dir.join("device.h").display()
        ))
        .arg(tmp.join("libraries.cpp"))
        .arg("-o")
        .arg(tmp.join(LIBRARY))
        .arg("-ldl")
        .output()
        .map_err(|e| format!("no C++ compiler ({cxx}: {e}); install g++ or name one in CXX"))?;
    if !out.status.success() {
        return Err(format!(
            "{cxx} failed on the emulated CUDA libraries:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    for n in NAMES {
        std::os::unix::fs::symlink(LIBRARY, tmp.join(n)).map_err(|e| e.to_string())?;
    }
    // Renamed into place whole: concurrent builds (test binaries run at once) each finish
    // their own folder, and the first rename wins.
    if std::fs::rename(&tmp, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    if dir.join(LIBRARY).exists() {
        Ok(dir)
    } else {
        Err(format!("{} was not made", dir.join(LIBRARY).display()))
    }
}

/// Reruns this test binary's tests but those named in `skip` (the caller among them) on the
/// emulated device, with the GPU required (a test that skips fails), and fails with the
/// child's output if any fails. `what` names the tests in messages.
pub fn rerun_on_emulated_device(what: &str, skip: &[&str]) {
    if in_child() {
        return;
    }
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR"));
    let dir = match build(&root) {
        Ok(d) => d,
        Err(e) => {
            tensor::skip::skip(what, "emu", &e);
            return;
        }
    };
    let exe = std::env::current_exe().expect("the test binary's path");
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get().min(4));
    let mut cmd = Command::new(&exe);
    for name in skip {
        cmd.args(["--skip", name]);
    }
    let out = cmd
        .args(["--test-threads", &threads.to_string()])
        .env(CHILD_ENV, "1")
        .env("XTRAIN_CUDA_LIB_PATH", &dir)
        .env("XTRAIN_KERNEL_CACHE", dir.join("kernels"))
        .env("XTRAIN_REQUIRE_GPU", "1")
        .output()
        .expect("the test binary runs again");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "{what} failed on the emulated CUDA device ({}):\n{text}",
        dir.display()
    );
    let summary = text
        .lines()
        .filter(|l| l.starts_with("test result"))
        .collect::<Vec<_>>()
        .join("; ");
    // Straight to the process's stderr (the harness captures eprintln!): CI's log shows it.
    use std::io::Write;
    let _ = writeln!(
        std::io::stderr().lock(),
        "\n{what} on the emulated CUDA device: {summary}"
    );
}
