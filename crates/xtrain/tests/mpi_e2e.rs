//! The MPI backend end to end, where Open MPI is installed (CI installs Debian's
//! `openmpi-bin` and `libopenmpi-dev`): builds `xtrain` with the `mpi` feature (beside the
//! plain build, copied to `target/mpi`), then `mpirun -np 4 xtrain train …` trains with the same
//! losses on MPI's collectives as on the own ones, over data parallel with ZeRO-3, tp × dp with
//! sequence parallelism, pipeline × dp and expert parallelism; and `xtrain bench comm
//! --backend mpi` checks and times every benchmarked collective on both; comm-mpi's `mpi_parity`
//! example compares every operation bit for bit. Without `mpirun` the
//! test says on stderr that it was skipped, and passes, except where `XTRAIN_REQUIRE` lists
//! `mpi` (CI sets it), where a skip fails.
mod common;
use common::*;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Added to `FAST_RUN`: one sequence per micro-batch, three steps.
const SMALL: [&str; 6] = [
    "--set",
    "train.micro_batch=1",
    "--set",
    "train.min_lr=1e-3",
    "--set",
    "train.steps=3",
];

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|p| std::env::split_paths(&p).any(|d| d.join(program).is_file()))
}

/// Says why the test did not run (a failure where `XTRAIN_REQUIRE` lists `mpi`, as CI's does).
fn skip(reason: &str) {
    tensor::skip::skip(
        "MPI test",
        "mpi",
        &format!("{reason} (install openmpi-bin and libopenmpi-dev to run it)"),
    );
}

/// Builds `xtrain --features mpi` and comm-mpi's `mpi_parity` example with the profile and in
/// the target directory of this test's own build, so the dependencies are the ones already
/// built (a target directory of its own rebuilt all of them: 7.4 of a clean CI run's minutes;
/// here only `comm-mpi`, whose feature changes, and the `xtrain` crate are compiled again). Cargo releases
/// the directory's lock while tests run. The two programs are copied to `<target>/mpi/`, and
/// the plain `xtrain` the build replaced is put back for the tests that run after this one.
/// Returns the folder holding `xtrain` and `examples/mpi_parity`.
fn build_with_mpi() -> PathBuf {
    let own = Path::new(env!("CARGO_BIN_EXE_xtrain"));
    // .../target/<profile dir>/xtrain
    let profile_dir = own.parent().unwrap();
    let target = profile_dir.parent().unwrap();
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev",
        Some(other) => other,
        None => panic!("no profile folder in {}", own.display()),
    };
    let out = target.join("mpi");
    std::fs::create_dir_all(out.join("examples")).unwrap();
    // Fresh files (never through an existing path: cargo hard-links its outputs).
    let copy = |from: &Path, to: &Path| {
        let _ = std::fs::remove_file(to);
        std::fs::copy(from, to)
            .unwrap_or_else(|e| panic!("copying {} to {}: {e}", from.display(), to.display()));
    };
    let plain = out.join("xtrain.plain");
    copy(own, &plain);
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    // The whole workspace's feature resolution (that of the test build, dev-dependencies
    // included), so that every crate but `comm-mpi` and `xtrain` keeps its artifact: resolved
    // for `-p xtrain` alone, crates such as `bitflags` lose features the dev-dependencies turn
    // on, and `parallel` and `train` would be compiled again (two minutes of CI).
    let what = [
        "--workspace",
        "--features",
        "comm-mpi/mpi",
        "--bin",
        "xtrain",
        "--example",
        "mpi_parity",
    ];
    let built = Command::new(&cargo)
        .current_dir(&workspace)
        .args(["build", "--profile", profile])
        .args(what)
        .arg("--target-dir")
        .arg(target)
        .output()
        .expect("running cargo build");
    assert!(
        built.status.success(),
        "cargo build {what:?} failed:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    copy(own, &out.join("xtrain"));
    copy(
        &profile_dir.join("examples/mpi_parity"),
        &out.join("examples/mpi_parity"),
    );
    copy(&plain, own);
    out
}

/// A port free on this host now (for the own backend's rendezvous store under mpirun).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `mpirun -np 4 <exe> <args>` with `XTRAIN_BACKEND=<backend>`.
fn mpirun(exe: &Path, backend: &str, args: &[&str]) -> Output {
    Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "4"])
        .arg(exe)
        .args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env("XTRAIN_BACKEND", backend)
        .env("MASTER_PORT", free_port().to_string())
        .env("RUST_LOG", "comm=info")
        .env("RUST_BACKTRACE", "0")
        .env("XTRAIN_COMM_TIMEOUT", "120")
        .output()
        .expect("running mpirun")
}

#[test]
fn mpirun_trains_with_the_own_backends_losses_and_bench_compares_them() {
    if !on_path("mpirun") {
        return skip("mpirun is not on PATH");
    }
    if !on_path("mpicc") {
        return skip("mpirun is installed but not the MPI development files (mpicc)");
    }
    let release = build_with_mpi();
    // The plain binary is back in place: the MPI build's copy is what runs under mpirun.
    assert_ne!(
        std::fs::read(release.join("xtrain")).unwrap(),
        std::fs::read(env!("CARGO_BIN_EXE_xtrain")).unwrap()
    );
    let exe = release.join("xtrain");
    // Every operation, element type and reduction, on the world and on a reordered
    // sub-group: MPI's results are the own backend's, bit for bit.
    for np in ["3", "4"] {
        let out = Command::new("mpirun")
            .args(["--allow-run-as-root", "--oversubscribe", "-np", np])
            .arg(release.join("examples/mpi_parity"))
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env("MASTER_PORT", free_port().to_string())
            .env("XTRAIN_COMM_TIMEOUT", "120")
            .output()
            .expect("running mpirun");
        let text = ok(&out);
        assert!(text.contains("checks agree"), "{text}");
    }
    let d = tmp("mpi");
    let run = |backend: &str, name: &str, layout: &[&str]| -> Vec<(u64, f64)> {
        let out = d.join(format!("{name}-{backend}"));
        let args = [
            &[
                "train",
                "--quiet",
                "--nproc",
                "4",
                "--out",
                out.to_str().unwrap(),
            ][..],
            &FAST_RUN,
            &SMALL,
            layout,
        ]
        .concat();
        let log = ok(&mpirun(&exe, backend, &args));
        // The groups really ran on the backend asked for.
        let on_mpi = log.contains("group world[0,1,2,3]: rank 0 runs on MPI");
        let on_own = log.contains("group world[0,1,2,3]: rank 0 reaches shm [1, 2, 3] tcp []");
        assert!(
            (backend == "mpi" && on_mpi && !on_own) || (backend == "own" && on_own && !on_mpi),
            "{name} on {backend}:\n{log}"
        );
        losses(&out)
    };

    let single = d.join("single");
    ok(&xtrain(
        &[
            &["train", "--quiet", "--out", single.to_str().unwrap()][..],
            &FAST_RUN,
            &SMALL,
            &["--set", "train.grad_accum=4"],
        ]
        .concat(),
    ));
    close(
        &run("mpi", "dp4z3", &["--zero", "3"]),
        &losses(&single),
        "dp4 ZeRO-3 on MPI",
    );
    for (name, layout) in [
        (
            "tp2dp2sp",
            &["--tp", "2", "--sp", "--set", "train.grad_accum=2"][..],
        ),
        ("pp2dp2", &["--pp", "2", "--set", "train.grad_accum=2"]),
        (
            "ep2",
            &[
                "--preset",
                "moe-small",
                "--ep",
                "2",
                "--set",
                "train.steps=2",
            ],
        ),
    ] {
        let want = run("own", name, layout);
        close(
            &run("mpi", name, layout),
            &want,
            &format!("{name}: mpi vs own"),
        );
    }

    // Every benchmarked collective, checked (#wrong) and timed on both backends.
    for op in [
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "all_to_all",
        "broadcast",
    ] {
        let out = ok(&mpirun(
            &exe,
            "own",
            &[
                "bench",
                "comm",
                "--backend",
                "mpi",
                "--op",
                op,
                "--min",
                "4K",
                "--max",
                "64K",
                "--iters",
                "2",
                "--warmup",
                "1",
            ],
        ));
        assert!(
            out.contains("own collectives beside MPI's (Open MPI"),
            "{out}"
        );
        assert!(
            out.contains("owntime(us)") && out.contains("mpitime(us)"),
            "{out}"
        );
        assert!(out.contains("all results correct"), "{op}: {out}");
    }
    let _ = std::fs::remove_dir_all(&d);
}
