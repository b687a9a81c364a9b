//! One checkpoint format for every layout: each rank writes the tensor blocks it owns with
//! their place in the full tensor (Megatron's sharded-tensor idea, [`TensorSlice`]), and a
//! manifest records the mesh, the precision, the training position and every file's size and
//! CRC-32. A checkpoint saved at any layout loads at any other (dp, ZeRO stage, tp, sp,
//! precision; pp, cp, ep as they land) and exports to Hugging Face, because loading never
//! needs the saving layout: a rank asks for the elements of its own blocks and the reader
//! assembles them from whichever pieces hold them.
//!
//! ```text
//! step_000100/
//!   manifest.json              format, version, mesh, precision, training state, files, pieces
//!   config.toml  config.json   the resolved run config and the Hugging Face model config
//!   tokenizer.json             (when not the byte tokenizer)
//!   shard-00000.safetensors    rank 0's pieces: `param/<tensor>@<start>`, `exp_avg/…`,
//!   shard-00001.safetensors      `exp_avg_sq/…` (fp32, 1-D: elements start.. of the block),
//!                                and under PowerSGD `grad_comm_error/…` (the ranks' mean
//!                                error feedback, which reshards like the moments), and with
//!                                an update held back `pending_grad/…` (below)
//! ```
//!
//! ZeRO-Offload's delayed update (`executor::delayed`) holds a step's gradients until the next
//! step: a checkpoint taken between them records the master weights and moments before that
//! update, its gradients (`pending_grad`, unscaled by nothing: as the update reads them) and its
//! learning rate and clipping factor ([`TrainingState::pending_update`]). A run that delays
//! continues it exactly; any other reader applies it first ([`PendingUpdate::apply`]), so the
//! weights it sees have every step's update.
//!
//! A piece is elements `start .. start + len` (row-major) of a block: ZeRO cuts a rank's flat
//! buffer anywhere, so a piece may hold part of a block. Blocks held by several ranks
//! (replicated tensors under tp, every tensor under plain data parallelism) are written by
//! their owner only, so the pieces of a tensor cover it exactly once.
//!
//! Saving is a collective of the world ([`save`]): rank 0 creates a staging directory, every
//! rank writes its shard file, rank 0 writes the manifest and renames the directory into
//! place, replacing an older checkpoint of the same name as a whole. Loading verifies the
//! checksum of every file before reading a byte of it.
mod files;
mod reader;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use comm::ProcessGroup;
use serde::{Deserialize, Serialize};

pub use files::{set_latest, FileEntry};
pub use reader::Checkpoint;

use crate::placement::TensorSlice;
use crate::precision::{LossScaler, Precision};
use crate::ParallelError;

pub const MANIFEST: &str = "manifest.json";
pub const FORMAT: &str = "xtrain-checkpoint";
pub const VERSION: u32 = 2;

/// A checkpoint error, naming the checkpoint.
#[derive(Debug, thiserror::Error)]
#[error("checkpoint {}: {msg}", path.display())]
pub struct CheckpointError {
    pub path: PathBuf,
    pub msg: String,
}

impl CheckpointError {
    pub fn at(path: &Path, msg: impl Into<String>) -> Self {
        CheckpointError {
            path: path.to_path_buf(),
            msg: msg.into(),
        }
    }
}

impl From<CheckpointError> for ParallelError {
    fn from(e: CheckpointError) -> Self {
        ParallelError::Checkpoint(e.to_string())
    }
}

/// The three per-parameter buffers a checkpoint holds (all fp32: master weights whatever the
/// compute precision, and AdamW's moments).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Param,
    ExpAvg,
    ExpAvgSq,
    /// PowerSGD's error feedback, the mean over the dp ranks (present when
    /// [`TrainingState::grad_comm_error`] says so).
    GradCommError,
    /// The gradients of an update held back by the delayed update (present when
    /// [`TrainingState::pending_update`] is).
    PendingGrad,
}

impl Kind {
    /// The buffers every checkpoint holds.
    pub const ALL: [Kind; 3] = [Kind::Param, Kind::ExpAvg, Kind::ExpAvgSq];
    pub fn name(self) -> &'static str {
        match self {
            Kind::Param => "param",
            Kind::ExpAvg => "exp_avg",
            Kind::ExpAvgSq => "exp_avg_sq",
            Kind::GradCommError => "grad_comm_error",
            Kind::PendingGrad => "pending_grad",
        }
    }
    /// The safetensors key of a piece.
    fn key(self, tensor: &str, start: usize) -> String {
        format!("{}/{tensor}@{start}", self.name())
    }
}

/// The mesh a checkpoint was saved on (informational: any mesh loads it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshRecord {
    pub pp: usize,
    pub dp: usize,
    pub cp: usize,
    pub tp: usize,
    pub ep: usize,
    pub zero: usize,
    pub sp: bool,
    pub virtual_stages: usize,
}

impl From<&crate::dims::ParallelDims> for MeshRecord {
    fn from(d: &crate::dims::ParallelDims) -> Self {
        MeshRecord {
            pp: d.pp,
            dp: d.dp,
            cp: d.cp,
            tp: d.tp,
            ep: d.ep,
            zero: d.zero.index(),
            sp: d.sp,
            virtual_stages: d.virtual_stages,
        }
    }
}

/// Where training stands: what a resumed run continues from besides the tensors.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainingState {
    /// Optimizer steps completed; also the data position (sampling is a function of it).
    pub step: u64,
    pub tokens_seen: u64,
    /// Seed of the data sampler's random streams.
    pub data_seed: u64,
    /// AdamW's step counter (bias correction).
    pub adam_step: u64,
    pub loss_scaler: LossScaler,
    /// Every layer's router balancing bias (auxiliary-loss-free MoE balancing; empty lists
    /// for layers without one, none at all when it is off).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub router_bias: Vec<Vec<f32>>,
    /// Every piece also holds PowerSGD's mean error feedback ([`Kind::GradCommError`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub grad_comm_error: bool,
    /// An AdamW update computed from a step's gradients but not yet applied (the delayed
    /// update): its step is `adam_step`, its gradients every piece's [`Kind::PendingGrad`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pending_update: Option<PendingUpdate>,
}

/// The scalars of an AdamW update held back ([`TrainingState::pending_update`]).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PendingUpdate {
    /// The learning rate of its step.
    pub lr: f32,
    /// What its gradients are multiplied by: the clipping factor over the loss scale.
    pub factor: f32,
}

impl PendingUpdate {
    /// Applies the update at AdamW step `t` to elements of the master weights `p` and the
    /// moments `m`, `v` from the held gradients `g` of the same elements: the operations the
    /// delayed update itself runs (AdamW is elementwise, so any range of elements gives that
    /// range's values).
    #[allow(clippy::too_many_arguments)]
    pub fn apply(
        &self,
        opt: &model::optim::AdamW,
        t: u64,
        p: &mut [f32],
        g: &[f32],
        m: &mut [f32],
        v: &mut [f32],
    ) {
        opt.update_scaled(t, self.lr, opt.weight_decay, self.factor, p, g, m, v);
    }
}

/// One piece: elements `start .. start + len` of a block, in file `file`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PieceRecord {
    pub file: String,
    pub slice: TensorSlice,
    pub start: usize,
    pub len: usize,
}

/// `manifest.json`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    pub version: u32,
    pub mesh: MeshRecord,
    pub precision: Precision,
    pub state: TrainingState,
    pub files: BTreeMap<String, FileEntry>,
    pub pieces: Vec<PieceRecord>,
}

/// A piece a rank saves: the block, its elements `start..start + param.len()`, and the values
/// of the three buffers there.
#[derive(Clone, Debug)]
pub struct SavedPiece {
    pub slice: TensorSlice,
    pub start: usize,
    pub param: Vec<f32>,
    pub exp_avg: Vec<f32>,
    pub exp_avg_sq: Vec<f32>,
    /// PowerSGD's mean error feedback over the same elements (`None` without PowerSGD).
    pub grad_comm_error: Option<Vec<f32>>,
    /// The held-back update's gradients over the same elements (`None` without one).
    pub pending_grad: Option<Vec<f32>>,
}

/// What a whole checkpoint records besides the ranks' pieces.
#[derive(Clone, Debug)]
pub struct SaveMeta {
    pub mesh: MeshRecord,
    pub precision: Precision,
    pub state: TrainingState,
    /// Files rank 0 writes (config.toml, config.json, tokenizer.json).
    pub files: Vec<(String, Vec<u8>)>,
}

#[cfg(target_endian = "big")]
compile_error!("checkpoint files store little-endian f32 and are written by casting");

/// What a rank tells rank 0 about the shard file it wrote.
#[derive(Serialize, Deserialize)]
struct ShardReport {
    file: Option<(String, FileEntry)>,
    pieces: Vec<PieceRecord>,
    error: Option<String>,
}

/// Saves checkpoint `dir`: a collective over `world` (every rank calls it, with the pieces it
/// owns; `meta` is read on rank 0). See the module doc for the protocol.
pub fn save(
    dir: &Path,
    world: &ProcessGroup,
    pieces: &[SavedPiece],
    meta: &SaveMeta,
) -> Result<(), ParallelError> {
    let rank = world.rank();
    let begun = if rank == 0 {
        files::begin(dir).map(|_| ())
    } else {
        Ok(())
    };
    agree(world, begun, "creating the staging directory")?;
    let tmp = files::staging_dir(dir)?;
    let report = write_shard(&tmp, rank, pieces).unwrap_or_else(|e| ShardReport {
        file: None,
        pieces: Vec::new(),
        error: Some(e.to_string()),
    });
    let bytes = serde_json::to_vec(&report).expect("a report serialises");
    let (all, lens) = world.all_gather_v(&bytes)?;
    let mut reports = Vec::with_capacity(lens.len());
    let mut at = 0;
    for len in lens {
        let r: ShardReport = serde_json::from_slice(&all[at..at + len])
            .map_err(|e| CheckpointError::at(dir, format!("a rank's shard report: {e}")))?;
        reports.push(r);
        at += len;
    }
    if let Some((r, e)) = reports
        .iter()
        .enumerate()
        .find_map(|(r, s)| s.error.as_ref().map(|e| (r, e)))
    {
        return Err(
            CheckpointError::at(dir, format!("rank {r} could not write its shard: {e}")).into(),
        );
    }
    let done = if rank == 0 {
        finish(dir, &tmp, reports, meta)
    } else {
        Ok(())
    };
    agree(world, done, "writing the manifest")
}

/// Writes `pieces` into `tmp/shard-RRRRR.safetensors` (nothing when there are none).
fn write_shard(
    tmp: &Path,
    rank: usize,
    pieces: &[SavedPiece],
) -> Result<ShardReport, CheckpointError> {
    if pieces.is_empty() {
        return Ok(ShardReport {
            file: None,
            pieces: Vec::new(),
            error: None,
        });
    }
    let file = format!("shard-{rank:05}.safetensors");
    let mut views = Vec::with_capacity(3 * pieces.len());
    let mut records = Vec::with_capacity(pieces.len());
    for p in pieces {
        let len = p.param.len();
        if p.exp_avg.len() != len
            || p.exp_avg_sq.len() != len
            || p.grad_comm_error.as_ref().is_some_and(|e| e.len() != len)
            || p.pending_grad.as_ref().is_some_and(|e| e.len() != len)
            || p.start + len > p.slice.numel()
        {
            return Err(CheckpointError::at(
                tmp,
                format!("piece of {} does not fit its block", p.slice.name),
            ));
        }
        let buffers = [
            (Kind::Param, Some(&p.param)),
            (Kind::ExpAvg, Some(&p.exp_avg)),
            (Kind::ExpAvgSq, Some(&p.exp_avg_sq)),
            (Kind::GradCommError, p.grad_comm_error.as_ref()),
            (Kind::PendingGrad, p.pending_grad.as_ref()),
        ];
        for (kind, data) in buffers.iter().filter_map(|(k, d)| d.map(|d| (k, d))) {
            let view = safetensors::tensor::TensorView::new(
                safetensors::Dtype::F32,
                vec![len],
                bytemuck::cast_slice(data),
            )
            .map_err(|e| CheckpointError::at(tmp, e.to_string()))?;
            views.push((kind.key(&p.slice.name, p.start), view));
        }
        records.push(PieceRecord {
            file: file.clone(),
            slice: p.slice.clone(),
            start: p.start,
            len,
        });
    }
    let bytes = safetensors::serialize(views, &None)
        .map_err(|e| CheckpointError::at(tmp, e.to_string()))?;
    files::write_synced(&tmp.join(&file), &bytes)?;
    Ok(ShardReport {
        file: Some((file, FileEntry::of(&bytes))),
        pieces: records,
        error: None,
    })
}

/// Rank 0: the extra files, the manifest, and the rename into place.
fn finish(
    dir: &Path,
    tmp: &Path,
    reports: Vec<ShardReport>,
    meta: &SaveMeta,
) -> Result<(), CheckpointError> {
    let mut manifest = Manifest {
        format: FORMAT.into(),
        version: VERSION,
        mesh: meta.mesh,
        precision: meta.precision,
        state: meta.state.clone(),
        files: BTreeMap::new(),
        pieces: Vec::new(),
    };
    for (name, bytes) in &meta.files {
        if name == MANIFEST || name.contains('/') || name.starts_with("shard-") {
            return Err(CheckpointError::at(
                dir,
                format!("invalid file name {name}"),
            ));
        }
        files::write_synced(&tmp.join(name), bytes)?;
        manifest.files.insert(name.clone(), FileEntry::of(bytes));
    }
    for r in reports {
        if let Some((name, entry)) = r.file {
            manifest.files.insert(name, entry);
        }
        manifest.pieces.extend(r.pieces);
    }
    let text = serde_json::to_vec_pretty(&manifest).expect("a manifest serialises");
    files::write_synced(&tmp.join(MANIFEST), &text)?;
    files::commit(dir)
}

/// Every rank learns whether every rank's `local` step succeeded; a failure anywhere is an
/// error everywhere (naming the first failing rank), so no rank waits on one that gave up.
fn agree(
    world: &ProcessGroup,
    local: Result<(), CheckpointError>,
    what: &str,
) -> Result<(), ParallelError> {
    let mut flag = [if local.is_ok() {
        0i64
    } else {
        1 + world.rank() as i64
    }];
    let failed = flag[0];
    world.all_reduce(&mut flag, comm::ReduceOp::Max)?;
    local?;
    if flag[0] != 0 && failed == 0 {
        return Err(ParallelError::Checkpoint(format!(
            "rank {} failed while {what}",
            flag[0] - 1
        )));
    }
    Ok(())
}

/// Resolves a `--resume` (or `convert`, `generate`) argument: a checkpoint directory, or a run
/// directory whose `latest` names one. Checkpoints of older xtrain versions are named as such.
pub fn resolve(path: &Path) -> Result<PathBuf, CheckpointError> {
    if path.join(MANIFEST).is_file() {
        return Ok(path.to_path_buf());
    }
    let latest = path.join("latest");
    if latest.is_file() {
        let name = std::fs::read_to_string(&latest)
            .map_err(|e| CheckpointError::at(path, format!("reading latest: {e}")))?;
        let dir = path.join(name.trim());
        if dir.join(MANIFEST).is_file() {
            return Ok(dir);
        }
        return Err(CheckpointError::at(
            path,
            format!(
                "`latest` names {}, which holds no {MANIFEST}{}",
                name.trim(),
                legacy_hint(&dir)
            ),
        ));
    }
    if !path.exists() {
        return Err(CheckpointError::at(path, "does not exist"));
    }
    Err(CheckpointError::at(
        path,
        format!(
            "neither a checkpoint (no {MANIFEST}) nor a run directory (no `latest`){}",
            legacy_hint(path)
        ),
    ))
}

/// A note when `dir` looks like a checkpoint of the per-parallelism formats xtrain wrote
/// before the one format.
fn legacy_hint(dir: &Path) -> &'static str {
    let legacy = dir.join("rank-00000").is_dir()
        || dir.join("tp-0").is_dir()
        || dir.join("dp-checkpoints").is_dir()
        || dir.join("tp-checkpoints").is_dir();
    if legacy {
        "; it looks like a checkpoint of an older xtrain (per-parallelism format), which this version does not read"
    } else {
        ""
    }
}
