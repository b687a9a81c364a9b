//! Sharded data-parallel checkpoints that load into any dp size or ZeRO stage.
//!
//! Each rank that owns state writes its flat shard (parameters, AdamW m and v, padded to
//! `ceil(Φ/world)`) as its own atomically-saved, CRC-verified directory `rank-NNNNN` (through
//! [`train::checkpoint`]), with a `shard.json` stating the layout: total Φ, the world it was cut
//! for, its rank, the optimizer step and the unit sizes of the model. Replicated state (DDP) is
//! saved once, as world 1. Loading reads every shard, checks they describe one layout, and
//! re-cuts them for the loading configuration with [`crate::reshard`].
//!
//! A training run keeps them as `<run>/dp-checkpoints/step_NNNNNN/` with the run's
//! `config.toml` beside the shards, and `<run>/latest` naming the newest (the single-process
//! trainer's convention), so `xtrain train --resume <run or checkpoint>` finds both.
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::engine::{ShardRef, ShardState};
use crate::reshard::reshard;
use crate::shard::ShardSpec;
use crate::ParallelError;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct ShardMeta {
    total: usize,
    world: usize,
    rank: usize,
    step: u64,
    /// Sizes of the model's units, so a checkpoint of another model is refused.
    units: Vec<usize>,
    shard_len: usize,
}

const META: &str = "shard.json";
/// The run configuration saved beside the shards.
pub const CONFIG: &str = "config.toml";
/// Where a run keeps its sharded checkpoints, relative to the run directory.
pub const DIR: &str = "dp-checkpoints";
const BUFFERS: [&str; 3] = ["params.f32", "exp_avg.f32", "exp_avg_sq.f32"];

fn err(dir: &Path, msg: impl std::fmt::Display) -> ParallelError {
    ParallelError::Checkpoint(format!("{}: {msg}", dir.display()))
}

/// Writes `state` into `dir/rank-NNNNN` (`units`: the model's unit sizes), straight from the
/// borrowed buffers (one byte copy each, zero-padded to the shard length).
pub fn save_shard(dir: &Path, state: &ShardRef, units: &[usize]) -> Result<(), ParallelError> {
    let shard_len = state.shard_len();
    let meta = ShardMeta {
        total: state.total,
        world: state.world,
        rank: state.rank,
        step: state.step,
        units: units.to_vec(),
        shard_len,
    };
    let mut files = vec![(
        META.to_string(),
        serde_json::to_vec_pretty(&meta).map_err(|e| err(dir, e))?,
    )];
    for (name, buf) in BUFFERS
        .iter()
        .zip([state.params, state.exp_avg, state.exp_avg_sq])
    {
        if buf.len() > shard_len {
            return Err(err(dir, format!("{name} holds more than a shard")));
        }
        let mut bytes = Vec::with_capacity(shard_len * 4);
        bytes.extend(buf.iter().flat_map(|x| x.to_le_bytes()));
        bytes.resize(shard_len * 4, 0);
        files.push((name.to_string(), bytes));
    }
    std::fs::create_dir_all(dir).map_err(|e| err(dir, e))?;
    let sub = dir.join(format!("rank-{:05}", state.rank));
    train::checkpoint::save(&sub, &files, Default::default()).map_err(|e| err(&sub, e))
}

fn f32s(dir: &Path, name: &str, bytes: &[u8], want: usize) -> Result<Vec<f32>, ParallelError> {
    if bytes.len() != want * 4 {
        return Err(err(
            dir,
            format!("{name} holds {} bytes, expected {}", bytes.len(), want * 4),
        ));
    }
    Ok(bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect())
}

/// Reads every shard of the checkpoint in `dir`, verified and in rank order; `units` must match.
pub fn load_shards(dir: &Path, units: &[usize]) -> Result<Vec<ShardState>, ParallelError> {
    let mut subs: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| err(dir, e))?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("rank-"))
        })
        .collect();
    subs.sort();
    if subs.is_empty() {
        return Err(err(dir, "no rank-NNNNN shard directories"));
    }
    let mut out = Vec::new();
    for sub in &subs {
        let files = train::checkpoint::load(sub).map_err(|e| err(sub, e))?;
        let get = |n: &str| files.get(n).ok_or_else(|| err(sub, format!("missing {n}")));
        let meta: ShardMeta = serde_json::from_slice(get(META)?).map_err(|e| err(sub, e))?;
        if meta.units != units {
            return Err(err(
                sub,
                format!("saved for units {:?}, the model has {units:?}", meta.units),
            ));
        }
        let spec = ShardSpec::new(meta.total, meta.world)?;
        if meta.shard_len != spec.shard_len() || meta.rank != out.len() {
            return Err(err(sub, "shard length or rank does not match its layout"));
        }
        let mut bufs = BUFFERS
            .iter()
            .map(|n| f32s(sub, n, get(n)?, meta.shard_len));
        let (params, exp_avg, exp_avg_sq) = (
            bufs.next().unwrap()?,
            bufs.next().unwrap()?,
            bufs.next().unwrap()?,
        );
        out.push(ShardState {
            total: meta.total,
            world: meta.world,
            rank: meta.rank,
            step: meta.step,
            params,
            exp_avg,
            exp_avg_sq,
        });
    }
    let first = &out[0];
    if out.len() != first.world
        || out
            .iter()
            .any(|s| (s.total, s.world, s.step) != (first.total, first.world, first.step))
    {
        return Err(err(
            dir,
            format!(
                "found {} shards that do not form one world-{} checkpoint",
                out.len(),
                first.world
            ),
        ));
    }
    Ok(out)
}

/// One buffer (`f`: parameters, m or v) of saved shards, re-cut for rank `rank` of `world`.
pub fn reshard_buffer(
    states: &[ShardState],
    world: usize,
    rank: usize,
    f: fn(&ShardState) -> &Vec<f32>,
) -> Result<Vec<f32>, ParallelError> {
    let first = states
        .first()
        .ok_or_else(|| ParallelError::Checkpoint("no shards".into()))?;
    let old = ShardSpec::new(first.total, first.world)?;
    let new = ShardSpec::new(first.total, world)?;
    let refs: Vec<&[f32]> = states.iter().map(|s| f(s).as_slice()).collect();
    reshard(&old, &refs, &new, rank)
}

/// Writes the run configuration into checkpoint `dir` (write, then rename: never half-written).
pub fn save_config(dir: &Path, toml_text: &str) -> Result<(), ParallelError> {
    let tmp = dir.join(format!(".{CONFIG}.tmp"));
    std::fs::write(&tmp, toml_text).map_err(|e| err(&tmp, e))?;
    std::fs::rename(&tmp, dir.join(CONFIG)).map_err(|e| err(dir, e))
}

/// The run configuration saved in checkpoint `dir`.
pub fn load_config(dir: &Path) -> Result<String, ParallelError> {
    std::fs::read_to_string(dir.join(CONFIG)).map_err(|e| err(dir, format!("{CONFIG}: {e}")))
}

/// Whether `dir` holds a sharded checkpoint (its first shard directory).
pub fn is_sharded(dir: &Path) -> bool {
    dir.join("rank-00000").is_dir()
}

/// Resolves a `--resume` argument to a sharded checkpoint: the checkpoint itself, or a run
/// directory whose `latest` names one. `None` when it is neither (e.g. a single-process
/// checkpoint, which the caller handles).
pub fn resolve(path: &Path) -> Option<PathBuf> {
    if is_sharded(path) {
        return Some(path.to_path_buf());
    }
    let name = std::fs::read_to_string(path.join("latest")).ok()?;
    let dir = path.join(name.trim());
    is_sharded(&dir).then_some(dir)
}
