//! Tests that cannot run on this machine say so, visibly, and fail instead where the run
//! requires them.
//!
//! A test that needs something the machine may lack (a CPU feature, root and `ip netns`,
//! Open MPI, a GPU) calls [`skip`] when it is absent: one line `SKIPPED <test>: <reason>` goes
//! straight to the process's stderr (the test harness captures `eprintln!`, and a skip must be
//! seen), once per test and reason. Where `XTRAIN_REQUIRE` names the requirement (a comma
//! separated list: `netns`, `mpi`, `gpu`, `multigpu` (two GPUs or more), `nvrtc`, `emu` (a C++
//! compiler, for the GPU tests on the emulated CUDA device), `avx512`, `amx`, or `all`) the skip is a failure instead, so a CI run that should prove something cannot pass
//! without proving it. `XTRAIN_REQUIRE_GPU=1` is the same as `gpu` in the list.

use std::collections::HashSet;
use std::io::Write;
use std::sync::Mutex;

/// Environment variable listing the requirements whose absence fails a test.
pub const REQUIRE_ENV: &str = "XTRAIN_REQUIRE";

/// Whether `XTRAIN_REQUIRE` (or `XTRAIN_REQUIRE_GPU=1` for `gpu`) names `requirement`.
pub fn required(requirement: &str) -> bool {
    let listed = std::env::var(REQUIRE_ENV).is_ok_and(|v| {
        v.split(',')
            .map(|s| s.trim().to_ascii_lowercase())
            .any(|s| s == "all" || s == requirement)
    });
    listed || (requirement == "gpu" && std::env::var("XTRAIN_REQUIRE_GPU").is_ok_and(|v| v == "1"))
}

/// Reports that `test` did not run because `requirement` is missing (`reason` says what and
/// how to get it): one visible line on stderr, or a panic when the requirement is required.
pub fn skip(test: &str, requirement: &str, reason: &str) {
    if required(requirement) {
        panic!("{test}: {reason}, and {REQUIRE_ENV} requires `{requirement}`");
    }
    static SEEN: Mutex<Option<HashSet<String>>> = Mutex::new(None);
    let line = format!("SKIPPED {test}: {reason}");
    let first = SEEN
        .lock()
        .map(|mut s| s.get_or_insert_with(HashSet::new).insert(line.clone()))
        .unwrap_or(true);
    if first {
        let _ = writeln!(std::io::stderr().lock(), "\n{line}");
    }
}

/// [`skip`] for a CPU feature `feature` (e.g. `AVX-512F`); the requirement is the feature's
/// name in lower case without punctuation (`avx512f`, or `amx` for any AMX feature list).
pub fn cpu_feature(test: &str, feature: &str) {
    let requirement: String = if feature.to_ascii_lowercase().contains("amx") {
        "amx".into()
    } else {
        feature
            .chars()
            .filter(|c| c.is_ascii_alphanumeric())
            .collect::<String>()
            .to_ascii_lowercase()
    };
    skip(test, &requirement, &format!("this CPU lacks {feature}"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requirements_are_read_from_the_list() {
        // The variable is process-wide; this test reads it only through a name no other test
        // uses.
        assert!(!required("no-such-requirement-xyz"));
        skip(
            "skip_test",
            "no-such-requirement-xyz",
            "nothing is missing really",
        );
    }
}
