//! `parallelize`: from the model's configuration and the mesh to what one rank runs. The passes
//! apply in Megatron's order, each in its own folder, and a pass of size 1 is the identity:
//!
//! 1. tensor parallelism (+ sequence parallelism): [`crate::tensor_parallel::shard_model`];
//! 2. context parallelism (cp): not implemented yet — a clear error;
//! 3. expert parallelism (ep): not implemented yet — a clear error;
//! 4. the pipeline split: [`crate::pipeline_parallel::split`] picks this rank's stages;
//! 5. data parallelism / ZeRO over dp × cp: the executor's configuration
//!    ([`crate::executor::ExecConfig`]) and the group returned here.
use comm::ProcessGroup;
use model::layers::Recompute;
use model::ModelConfig;

use crate::decoder::DecoderStage;
use crate::dims::Mesh;
use crate::executor::Pipeline;
use crate::pipeline_parallel::split::{rank_stages, stage_parts};
use crate::ParallelError;

/// Model-side options of the passes.
#[derive(Clone, Copy, Debug)]
pub struct ModelOptions {
    /// Training sequence length (checked against cp and sp).
    pub seq_len: usize,
    /// Activation recomputation of every block.
    pub recompute: Recompute,
}

/// What one rank runs: its part of the model and the groups the executor drives it over.
pub struct Parallelized {
    pub stage: DecoderStage,
    /// The group dense gradients are averaged over (dp × cp).
    pub dp: ProcessGroup,
    /// The pipeline (pp > 1).
    pub pipe: Option<Pipeline>,
}

fn not_yet(what: &str) -> ParallelError {
    ParallelError::Unsupported(format!(
        "{what} is not implemented yet: this build runs dp (ZeRO 0-3) × tp (+sp)"
    ))
}

/// Applies the passes of the module doc to `cfg` for this rank of `mesh`.
pub fn parallelize(
    cfg: &ModelConfig,
    mesh: &Mesh,
    opts: &ModelOptions,
) -> Result<Parallelized, ParallelError> {
    let dims = *mesh.dims();
    cfg.validate()
        .map_err(|e| ParallelError::Config(e.to_string()))?;
    dims.validate_model(cfg, opts.seq_len)?;
    // 1. Tensor (and sequence) parallelism.
    let tp = if dims.tp > 1 {
        Some(crate::tensor_parallel::shard_model(
            cfg,
            mesh.tp()?,
            dims.sp,
        )?)
    } else {
        None
    };
    // 2., 3.
    if dims.cp > 1 {
        return Err(not_yet("context parallelism (cp > 1)"));
    }
    if dims.ep > 1 {
        return Err(not_yet("expert parallelism (ep > 1)"));
    }
    // 4. The pipeline split: this rank's stages, their parts, and which rank runs each stage.
    let stages = dims.pp * dims.virtual_stages;
    let pp_rank = mesh.coord("pp")?;
    let mine = rank_stages(pp_rank, dims.pp, dims.virtual_stages);
    let mut parts = Vec::new();
    let mut local = Vec::new();
    for &s in &mine {
        let p = stage_parts(cfg.num_hidden_layers, stages, s)?;
        local.push((s, parts.len()..parts.len() + p.len()));
        parts.extend(p);
    }
    let pipe = if dims.pp > 1 {
        Some(Pipeline {
            group: mesh.pp()?,
            stage_rank: (0..stages).map(|s| s % dims.pp).collect(),
            local,
        })
    } else {
        None
    };
    let stage = DecoderStage::new(cfg, tp, parts, opts.recompute)?;
    // 5. Data parallelism over dp × cp.
    let dp = mesh.dp_cp()?;
    Ok(Parallelized { stage, dp, pipe })
}
