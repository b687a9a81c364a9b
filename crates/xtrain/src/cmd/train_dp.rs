//! `xtrain train --nproc N --dp N --zero K`: data-parallel training. Without a launch
//! environment the command re-runs itself as `N` worker processes through the launcher
//! machinery (`xtrain launch`'s process group); each worker joins the job's communicator and
//! runs [`parallel::worker::run`]. Sharded checkpoints go to `<out>/dp-checkpoints/step_N`
//! (`<out>/latest` names the newest); `--resume` continues from one at any dp size or stage.
use anyhow::Result;
use std::path::Path;
use std::time::Duration;
use train::RunConfig;

use super::launch::{run_group, GroupSpec};

/// Whether a run config asks for data parallelism (more than one process or rank).
pub fn wants_dp(cfg: &RunConfig) -> bool {
    let p = &cfg.parallel;
    p.nproc > 1 || p.dp > 1 || p.zero > 0 || p.tp > 1 || p.sp
}

/// Runs `cfg` data-parallel (continuing from the sharded checkpoint `resume`, if given):
/// spawns the workers when not inside a launched job, else trains. `--nproc N` alone means
/// `--dp N / tp`. With `--tp` / `--sp` (or a tensor-parallel checkpoint, `tp-*` shards, as
/// `resume`) the workers run the `dp × tp` trainer of [`parallel::tensor_parallel::worker`].
pub fn run(cfg: &RunConfig, out: Option<&Path>, resume: Option<&Path>) -> Result<()> {
    let tp_resume = resume.and_then(parallel::tensor_parallel::worker::resolve);
    let mut cfg = cfg.clone();
    if cfg.parallel.dp == 1 && cfg.parallel.nproc > cfg.parallel.tp {
        cfg.parallel.dp = cfg.parallel.nproc / cfg.parallel.tp.max(1);
    }
    let cfg = &cfg;
    if comm::env::LaunchEnv::from_env().is_err() {
        let mut command = vec![std::env::current_exe()?.into_os_string()];
        command.extend(std::env::args_os().skip(1));
        let spec = GroupSpec {
            nproc_per_node: cfg.parallel.nproc,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: None,
            max_restarts: 0,
            grace: Duration::from_secs(5),
            job_id: None,
            command,
            extra_env: Vec::new(),
            prefix_stdout: false,
        };
        run_group(&spec)?;
        return Ok(());
    }
    let (comm, _) = comm::env::init_from_env()?;
    if cfg.parallel.tp > 1 || cfg.parallel.sp || tp_resume.is_some() {
        let s =
            parallel::tensor_parallel::worker::run(cfg, &comm, out, tp_resume.as_deref(), true)?;
        if comm.world().rank() == 0 {
            println!(
                "loss {:.4} -> {:.4}{}",
                s.losses.first().copied().unwrap_or(f32::NAN),
                s.losses.last().copied().unwrap_or(f32::NAN),
                out.map(|o| format!(
                    " ; tp-sharded checkpoints in {}",
                    o.join(parallel::tensor_parallel::worker::DIR).display()
                ))
                .unwrap_or_default()
            );
        }
        return Ok(());
    }
    let opts = parallel::worker::DpRunOptions {
        out: out.map(Path::to_path_buf),
        resume: resume.map(Path::to_path_buf),
        log: true,
    };
    let s = parallel::worker::run(cfg, &comm, &opts)?;
    if comm.world().rank() == 0 {
        println!(
            "loss {:.4} -> {:.4}",
            s.losses.first().copied().unwrap_or(f32::NAN),
            s.losses.last().copied().unwrap_or(f32::NAN),
        );
    }
    Ok(())
}
