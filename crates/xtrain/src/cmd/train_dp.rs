//! `xtrain train --nproc N --dp N --zero K`: data-parallel training. Without a launch
//! environment the command re-runs itself as `N` worker processes through the launcher
//! machinery (`xtrain launch`'s process group); each worker joins the job's communicator and
//! runs [`parallel::worker::run`]. The sharded checkpoint goes to `<out>/dp-checkpoint`.
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

/// Runs `cfg` data-parallel: spawns the workers when not inside a launched job, else trains.
/// `--nproc N` alone means `--dp N` (data parallelism is the only layout wired in so far).
pub fn run(cfg: &RunConfig, out: &Path, resume: Option<&Path>) -> Result<()> {
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
    if cfg.parallel.tp > 1 || cfg.parallel.sp || resume.is_some() {
        let ckpt = out.join("tp-checkpoint");
        let s = parallel::tensor_parallel::worker::run(cfg, &comm, Some(&ckpt), resume, true)?;
        if comm.world().rank() == 0 {
            println!(
                "loss {:.4} -> {:.4} ; tp-sharded checkpoint {}",
                s.losses.first().copied().unwrap_or(f32::NAN),
                s.losses.last().copied().unwrap_or(f32::NAN),
                ckpt.display()
            );
        }
        return Ok(());
    }
    let ckpt = out.join("dp-checkpoint");
    let s = parallel::worker::run(cfg, &comm, Some(&ckpt), true)?;
    if comm.world().rank() == 0 {
        println!(
            "loss {:.4} -> {:.4} ; sharded checkpoint {}",
            s.losses.first().copied().unwrap_or(f32::NAN),
            s.losses.last().copied().unwrap_or(f32::NAN),
            ckpt.display()
        );
    }
    Ok(())
}
