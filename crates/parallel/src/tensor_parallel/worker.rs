//! A `dp × tp` training run of a [`RunConfig`] on one rank: the world laid out as the mesh
//! `[dp, tp]` (tp fastest-varying, so tp neighbours are adjacent ranks), a [`TpModel`] shard over
//! the tp group driven by the data-parallel engine (any ZeRO stage) over the dp group. The data
//! stream is the data-parallel one, indexed by the dp coordinate (all tp ranks of a replica
//! read the same batch). With a run directory, rank 0 also writes `config.toml`, `metrics.jsonl`
//! (with validation) and the loss plot through the data-parallel run log.
//!
//! Checkpoints: with a run directory `out`, tp rank `r` saves its engine's sharded checkpoint
//! under `out/tp-checkpoints/step_NNNNNN/tp-r` every `train.ckpt_every` steps and at the end;
//! once every rank has written its part, rank 0 points `out/latest` at the step (so a save cut
//! short never becomes the one resumed from: [`resolve`] follows `latest`). Loading reads every `tp-*` directory of a checkpoint saved at any tp (and dp / ZeRO) size, rebuilds
//! each old tp shard's full local state, re-cuts parameters *and* AdamW moments through the full
//! layout for this tp size ([`TpPlan::reshard_from`]), and restores the engine.
use std::path::{Path, PathBuf};

use comm::{Communicator, DeviceMesh};
use train::config::Precision as TrainPrecision;
use train::RunConfig;

use super::model::TpModel;
use super::plan::TpPlan;
use super::staged::StagedTp;
use crate::checkpoint::{load_shards, reshard_buffer};
use crate::engine::{DataParallel, ShardState};
use crate::memory::ZeroStage;
use crate::run_log::rank0_outputs;
use crate::worker::{dp_config, evaluate, model_config, DpRunSummary, RunInputs};
use crate::ParallelError;

fn cfg_err(e: impl std::fmt::Display) -> ParallelError {
    ParallelError::Config(e.to_string())
}

/// Unit sizes of a plan's local shard (embedding, blocks, head), as the engine saves them.
fn unit_sizes(plan: &TpPlan) -> Vec<usize> {
    let l = &plan.local_layout;
    let mut u = vec![l.embed_range().len()];
    u.extend((0..l.num_blocks()).map(|i| l.block_range(i).len()));
    u.push(l.head_range().len());
    u
}

/// Where a run's tensor-parallel checkpoints live, below its run directory.
pub const DIR: &str = "tp-checkpoints";

/// Resolves a `--resume` argument to a tensor-parallel checkpoint: a directory holding `tp-0`,
/// or a run directory whose `latest` names one. `None` when it is neither.
pub fn resolve(path: &Path) -> Option<PathBuf> {
    let is_tp = |d: &Path| d.join("tp-0").is_dir();
    if is_tp(path) {
        return Some(path.to_path_buf());
    }
    let name = std::fs::read_to_string(path.join("latest")).ok()?;
    let dir = path.join(name.trim());
    is_tp(&dir).then_some(dir)
}

/// Saves step `step` of every tp rank into `out/tp-checkpoints/step_NNNNNN/tp-r` and, once all
/// ranks have written theirs, points `out/latest` at it. A collective over the world.
fn save(
    engine: &DataParallel<StagedTp>,
    world: &comm::ProcessGroup,
    out: &Path,
    tp_rank: usize,
    step: usize,
) -> Result<(), ParallelError> {
    let name = format!("{DIR}/step_{step:06}");
    engine.save_checkpoint(&out.join(&name).join(format!("tp-{tp_rank}")))?;
    // `latest` moves only after every tp rank's part is on disk.
    world.barrier()?;
    if world.rank() == 0 {
        train::checkpoint::set_latest(out, &name)
            .map_err(|e| ParallelError::Checkpoint(e.to_string()))?;
    }
    world.barrier()?;
    Ok(())
}

/// This tp rank's engine state from a checkpoint saved at any tp size (see the module doc).
pub fn load_resharded(dir: &Path, plan: &TpPlan, rank: usize) -> Result<ShardState, ParallelError> {
    let old_tp = (0..)
        .take_while(|r| dir.join(format!("tp-{r}")).is_dir())
        .count();
    if old_tp == 0 {
        return Err(ParallelError::Checkpoint(format!(
            "{}: no tp-0 directory (not a tensor-parallel checkpoint)",
            dir.display()
        )));
    }
    let old = TpPlan::new(&plan.cfg, old_tp, plan.sp)?;
    let saved = (0..old_tp)
        .map(|r| load_shards(&dir.join(format!("tp-{r}")), &unit_sizes(&old)))
        .collect::<Result<Vec<_>, _>>()?;
    let n = old.local_layout.total();
    let cut = |f: fn(&ShardState) -> &Vec<f32>| -> Result<Vec<f32>, ParallelError> {
        // Each old tp shard's full local buffer (its dp shards joined), then re-cut over tp.
        let locals = saved
            .iter()
            .map(|states| Ok(reshard_buffer(states, 1, 0, f)?[..n].to_vec()))
            .collect::<Result<Vec<_>, ParallelError>>()?;
        Ok(plan.reshard_from(&old, &locals)?.swap_remove(rank))
    };
    let step = saved[0]
        .first()
        .ok_or_else(|| ParallelError::Checkpoint(format!("{}: empty tp-0", dir.display())))?
        .step;
    Ok(ShardState {
        total: plan.local_layout.total(),
        world: 1,
        rank: 0,
        step,
        params: cut(|s| &s.params)?,
        exp_avg: cut(|s| &s.exp_avg)?,
        exp_avg_sq: cut(|s| &s.exp_avg_sq)?,
    })
}

/// Trains `cfg.train.steps` steps on this rank (optionally resuming from `resume`, saved at
/// any tp size); with a run directory `out`, checkpoints are saved as the module doc says.
/// Every rank calls it.
pub fn run(
    cfg: &RunConfig,
    comm: &Communicator,
    out: Option<&Path>,
    resume: Option<&Path>,
    log: bool,
) -> Result<DpRunSummary, ParallelError> {
    cfg.validate().map_err(cfg_err)?;
    let p = &cfg.parallel;
    let world = comm.world().size();
    if p.dp * p.tp != world || p.nproc != world {
        return Err(ParallelError::Config(format!(
            "parallel.dp × parallel.tp = {} × {} and parallel.nproc = {} must equal the number of ranks ({world})",
            p.dp, p.tp, p.nproc
        )));
    }
    let stage = ZeroStage::from_index(p.zero)
        .ok_or_else(|| cfg_err(format!("parallel.zero = {} (expected 0..=3)", p.zero)))?;
    let t = &cfg.train;
    if t.precision != TrainPrecision::Fp32 {
        return Err(cfg_err(format!(
            "train.precision = {:?}: tensor parallel trains in fp32 only so far",
            t.precision
        )));
    }
    if t.threads > 0 {
        tensor::threads::set_thread_budget(t.threads).map_err(cfg_err)?;
    }
    let mesh = DeviceMesh::new(comm, &[("dp", p.dp), ("tp", p.tp)])?;
    let (tp_group, dp_group) = (mesh.group(&["tp"])?, mesh.group(&["dp"])?);
    let (tp_rank, dp_rank) = (tp_group.rank(), dp_group.rank());
    let mc = model_config(cfg);
    let tp = TpModel::new(&mc, tp_group, p.sp)?;
    tp.plan.check_seq(cfg.model.seq_len)?;
    let plan = tp.plan.clone();
    let inputs = RunInputs::load(cfg, dp_rank)?;
    let dp_cfg = dp_config(cfg, stage, crate::memory::Precision::Fp32);
    let init = tp.shard_params(
        &model::Model::new(mc.clone())
            .map_err(cfg_err)?
            .init_params(t.seed),
    );
    let mut engine = DataParallel::new(StagedTp { tp }, dp_group, dp_cfg, &init)?;
    drop(init);
    let mut first = 0;
    if let Some(dir) = resume {
        engine.restore(&[load_resharded(dir, &plan, tp_rank)?])?;
        first = engine.step_count() as usize;
    }
    let rank = comm.world().rank();
    if log && rank == 0 {
        println!(
            "tensor parallel: dp={} × tp={}{} ZeRO-{}; {} of {} params per tp shard{}",
            p.dp,
            p.tp,
            if p.sp { " + sp" } else { "" },
            stage.index(),
            plan.local_layout.total(),
            plan.full_layout.total(),
            if first > 0 {
                format!("; resumed at step {first}")
            } else {
                String::new()
            }
        );
    }
    // Rank 0 writes config.toml, metrics.jsonl (with validation) and the loss plot, as the
    // single-process and data-parallel runs do.
    let (mut run_log, mut console) =
        rank0_outputs(rank, out, log, cfg, plan.full_layout.total(), first)?;
    let global_tokens = p.dp * t.micro_batch * t.grad_accum * cfg.model.seq_len;
    let mut losses = Vec::new();
    let mut step_ms = Vec::new();
    let mut comm_ms = Vec::new();
    for step in first..t.steps {
        let batches = inputs.batches(step)?;
        let lr = inputs.schedule.lr(step);
        engine.set_lr(lr as f32);
        let c0 = engine.model().tp.region.comm_nanos();
        let t0 = std::time::Instant::now();
        let s = engine.train_step(&batches)?;
        step_ms.push(t0.elapsed().as_secs_f64() * 1e3);
        comm_ms.push((engine.model().tp.region.comm_nanos() - c0) as f64 / 1e6);
        if !s.loss.is_finite() {
            return Err(ParallelError::Protocol(format!(
                "loss is {} at step {step}",
                s.loss
            )));
        }
        losses.push(s.loss);
        let done = step + 1;
        // Every rank evaluates the same held-out batches (the tp collectives need all).
        let eval_now = (t.eval_every > 0 && done % t.eval_every == 0) || done == t.steps;
        let val = if out.is_some() && eval_now {
            evaluate(&mut engine, cfg, &inputs.sampler, &inputs.data)?
        } else {
            None
        };
        let secs = step_ms.last().copied().unwrap_or(0.0) / 1e3;
        if let Some(l) = &mut run_log {
            l.step(done, &s, lr, global_tokens, secs, val)?;
        }
        if let Some(c) = &mut console {
            c.step(done, &s, lr, global_tokens, val, secs * 1e3, String::new);
        }
        if let Some(out) = out {
            if t.ckpt_every > 0 && done % t.ckpt_every == 0 && done < t.steps {
                save(&engine, comm.world(), out, tp_rank, done)?;
            }
        }
    }
    if let Some(c) = &console {
        c.finish();
    }
    if log && rank == 0 && !step_ms.is_empty() {
        let median = |v: &[f64]| {
            let mut s = v.to_vec();
            s.sort_by(f64::total_cmp);
            s[s.len() / 2]
        };
        // Time inside the tp activation collectives (region operators and the head's
        // statistics), waiting for the slower rank included; the rest is compute (and the
        // dp engine's own communication when dp > 1).
        let (st, cm) = (median(&step_ms), median(&comm_ms));
        println!(
            "median step {st:.1} ms; tp collectives {cm:.1} ms ({:.0}%), rest {:.1} ms",
            100.0 * cm / st,
            st - cm
        );
    }
    if let Some(out) = out {
        save(&engine, comm.world(), out, tp_rank, t.steps.max(first))?;
    }
    if let Some(l) = &run_log {
        l.finish()?;
    }
    Ok(DpRunSummary {
        losses,
        memory: engine.memory(),
        formula: engine.formula(),
    })
}
