//! Which slice of every parameter a tensor-parallel rank holds, and moving whole buffers
//! (parameters, gradients, optimizer moments) between the full layout and the ranks' shards.
//!
//! A rank's shard is itself a valid model: [`TpPlan::local_cfg`] is the full config with
//! `heads/tp`, `kv_heads/tp` (or one replicated KV head when `tp > kv_heads`), `ffn/tp`,
//! `expert_ffn/tp` and `⌈vocab/tp⌉`, and its flat layout has the same tensor names as the full
//! one. Per tensor ([`Split`]):
//! - attention: q split by heads (rows), k/v by whole KV heads (rows), o by input columns;
//! - MLP / shared expert: gate, up by rows, down by columns; MoE experts the same per expert
//!   (the fused `[E, 2F, H]` gate_up is `2E` row groups), the router replicated;
//! - embedding and LM head: by vocabulary rows, the vocabulary padded to a multiple of tp (the
//!   padding rows stay zero: no id looks them up and the vocab-parallel head leaves them out
//!   of the softmax); norms replicated.
//!
//! Tied embeddings (`tie_word_embeddings`): the local model is untied, and its `lm_head.weight`
//! is a *copy* of the embedding's block ([`TensorShard::tied_copy`]: the same full tensor, the
//! same vocabulary rows); the executor keeps the copies equal by summing their gradients
//! (`StageModel::tied_ranges`), and only the embedding's block is counted and saved.
//!
//! A replicated tensor whose gradient each rank only sees part of ([`TensorShard::partial_grad`]:
//! the router, replicated KV heads, and under sequence parallelism the norm gains) is summed
//! over its replicas by [`TpPlan::sync_grads`] before the optimizer step.

use comm::{ProcessGroup, ReduceOp};
use model::{Model, ModelConfig, ParamLayout, View};

use crate::placement::TensorSlice;
use crate::ParallelError;

/// How one tensor is cut over the tp group. `parts` distinct shards; rank `r` holds part
/// `r·parts/tp` (so `tp/parts` consecutive ranks hold the same part).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    /// Every rank holds the whole tensor.
    Replicated,
    /// Viewed as `[groups, rows, cols]`, each group's rows are cut into `parts`.
    Rows { groups: usize, parts: usize },
    /// The last dimension is cut into `parts`.
    Cols { parts: usize },
    /// Rows cut into `parts` blocks of `⌈rows/parts⌉` (the vocabulary); the last blocks are
    /// zero-padded past `rows`.
    PaddedRows { rows: usize, parts: usize },
}

impl Split {
    pub fn parts(&self) -> usize {
        match *self {
            Split::Replicated => 1,
            Split::Rows { parts, .. } | Split::Cols { parts } | Split::PaddedRows { parts, .. } => {
                parts
            }
        }
    }
}

/// One tensor's placement: its view in the full and in the local layout.
#[derive(Debug, Clone)]
pub struct TensorShard {
    pub name: String,
    pub full: View,
    pub local: View,
    pub split: Split,
    /// The local gradient is a partial sum over the tensor's replicas.
    pub partial_grad: bool,
    /// Expert parallelism: the tensor stacks experts and this rank holds some of them. Its
    /// block starts `lead` rows (of the split's `[groups·rows, cols]` or `[rows, cols]` view,
    /// counted in groups for `Rows`) into the full tensor, whose first dimension is
    /// `full_lead`.
    pub experts: Option<ExpertBlock>,
    /// The LM head of a model with tied embeddings: a copy of `model.embed_tokens.weight`
    /// (`name` and `full` are the embedding's), never counted or saved.
    pub tied_copy: bool,
}

/// Where a rank's experts sit in a stacked expert tensor (see [`TensorShard::experts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertBlock {
    /// Offset of the held block, in groups (`Rows`) or rows (`Cols`) of the full tensor.
    pub lead: usize,
    /// Groups (`Rows`) or rows (`Cols`) of the full tensor.
    pub full_lead: usize,
}

/// The tensor-parallel layout of one model config at one tp size.
#[derive(Debug, Clone)]
pub struct TpPlan {
    pub cfg: ModelConfig,
    pub local_cfg: ModelConfig,
    pub tp: usize,
    pub sp: bool,
    /// Expert parallelism: this rank's place among the `ep` ranks the experts are spread over
    /// (1 and 0 without it). Tensors other than the stacked experts are replicated over them.
    pub ep: usize,
    pub ep_rank: usize,
    pub full_layout: ParamLayout,
    pub local_layout: ParamLayout,
    pub tensors: Vec<TensorShard>,
}

fn divides(what: &str, n: usize, tp: usize) -> Result<usize, ParallelError> {
    if n.is_multiple_of(tp) {
        Ok(n / tp)
    } else {
        Err(ParallelError::Layout(format!(
            "{what} = {n} is not divisible by tp = {tp}"
        )))
    }
}

impl TpPlan {
    /// The plan of `cfg` over `tp` ranks (`sp`: sequence parallel). Impossible layouts are
    /// errors naming the offending size.
    pub fn new(cfg: &ModelConfig, tp: usize, sp: bool) -> Result<Self, ParallelError> {
        Self::with_experts(cfg, tp, sp, 1, 0)
    }

    /// [`Self::new`] with the experts spread over `ep` ranks, this one `ep_rank`: it holds
    /// experts `ep_rank·E/ep ..` of every MoE layer (each split over tp as without ep).
    pub fn with_experts(
        cfg: &ModelConfig,
        tp: usize,
        sp: bool,
        ep: usize,
        ep_rank: usize,
    ) -> Result<Self, ParallelError> {
        cfg.validate()
            .map_err(|e| ParallelError::Config(e.to_string()))?;
        if tp == 0 {
            return Err(ParallelError::Layout("tp must be >= 1".into()));
        }
        let mut lc = cfg.clone();
        // The head holds its own copy of the tied embedding (module doc).
        lc.tie_word_embeddings = false;
        lc.num_attention_heads = divides("num_attention_heads", cfg.num_attention_heads, tp)?;
        let kv = cfg.kv_heads();
        let kv_parts = if kv >= tp {
            lc.num_key_value_heads = Some(divides("num_key_value_heads", kv, tp)?);
            tp
        } else if tp.is_multiple_of(kv) {
            // Fewer KV heads than ranks: each rank holds the one KV head its query heads use.
            lc.num_key_value_heads = Some(1);
            kv
        } else {
            return Err(ParallelError::Layout(format!(
                "num_key_value_heads = {kv} < tp = {tp} and tp is not a multiple of it: \
                 KV heads cannot be replicated evenly"
            )));
        };
        lc.head_dim = Some(cfg.head_dim());
        lc.vocab_size = cfg.vocab_size.div_ceil(tp);
        if cfg.is_moe() {
            let f = divides("expert ffn size", cfg.expert_ffn(), tp)?;
            lc.moe_intermediate_size = Some(f);
            lc.intermediate_size = f;
            if cfg.shared_ffn() > 0 {
                lc.shared_expert_intermediate_size =
                    Some(divides("shared expert ffn size", cfg.shared_ffn(), tp)?);
            }
        } else {
            lc.intermediate_size = divides("intermediate_size", cfg.intermediate_size, tp)?;
        }
        if ep > 1 {
            if !cfg.is_moe() {
                return Err(ParallelError::Layout(
                    "expert parallelism (ep > 1) needs a model with experts".into(),
                ));
            }
            let per = cfg.num_local_experts / ep;
            if per == 0 || !cfg.num_local_experts.is_multiple_of(ep) || ep_rank >= ep {
                return Err(ParallelError::Layout(format!(
                    "num_local_experts = {} is not divisible by ep = {ep}",
                    cfg.num_local_experts
                )));
            }
            lc.expert_shard = Some(model::config::ExpertShard {
                first: ep_rank * per,
                count: per,
            });
        }
        lc.validate()
            .map_err(|e| ParallelError::Layout(format!("local shard config: {e}")))?;
        let full_layout = ParamLayout::new(cfg);
        let local_layout = ParamLayout::new(&lc);
        let (first, held) = lc.held_experts();
        let all_experts = cfg.num_local_experts;
        let tensors = local_layout
            .entries
            .iter()
            .map(|e| {
                let tied_copy = cfg.tie_word_embeddings && e.name == "lm_head.weight";
                let name = if tied_copy {
                    "model.embed_tokens.weight"
                } else {
                    e.name.as_str()
                };
                let full = full_layout
                    .get(name)
                    .ok_or_else(|| ParallelError::Layout(format!("{name} not in full layout")))?
                    .view
                    .clone();
                let n = name;
                let rows = Split::Rows {
                    groups: 1,
                    parts: tp,
                };
                let (split, partial_grad) =
                    if n.ends_with("layernorm.weight") || n == "model.norm.weight" {
                        (Split::Replicated, sp && tp > 1)
                    } else if n.ends_with("mlp.gate.weight") {
                        (Split::Replicated, tp > 1)
                    } else if n.ends_with("k_proj.weight") || n.ends_with("v_proj.weight") {
                        let s = Split::Rows {
                            groups: 1,
                            parts: kv_parts,
                        };
                        (s, kv_parts < tp)
                    } else if n.ends_with("o_proj.weight")
                        || n.ends_with("down_proj.weight")
                        || n.ends_with("experts.down_proj")
                    {
                        (Split::Cols { parts: tp }, false)
                    } else if n.ends_with("experts.gate_up_proj") {
                        let s = Split::Rows {
                            groups: 2 * held,
                            parts: tp,
                        };
                        (s, false)
                    } else if n == "model.embed_tokens.weight" || n == "lm_head.weight" {
                        let s = Split::PaddedRows {
                            rows: cfg.vocab_size,
                            parts: tp,
                        };
                        (s, false)
                    } else {
                        // q, gate, up.
                        (rows, false)
                    };
                // Stacked experts: gate_up in groups (2 per expert), down in rows (H per
                // expert) of its [E·H, F] view.
                let experts = if n.ends_with("experts.gate_up_proj") {
                    Some(ExpertBlock {
                        lead: 2 * first,
                        full_lead: 2 * all_experts,
                    })
                } else if n.ends_with("experts.down_proj") {
                    let h = full.shape[1];
                    Some(ExpertBlock {
                        lead: first * h,
                        full_lead: all_experts * h,
                    })
                } else {
                    None
                };
                Ok(TensorShard {
                    name: name.to_string(),
                    full,
                    local: e.view.clone(),
                    split,
                    partial_grad,
                    experts,
                    tied_copy,
                })
            })
            .collect::<Result<Vec<_>, ParallelError>>()?;
        Ok(TpPlan {
            cfg: cfg.clone(),
            local_cfg: lc,
            tp,
            sp,
            ep,
            ep_rank,
            full_layout,
            local_layout,
            tensors,
        })
    }

    /// The local shard as a model (its blocks still without region hooks).
    pub fn local_model(&self) -> Result<Model, ParallelError> {
        Model::new(self.local_cfg.clone()).map_err(|e| ParallelError::Model(e.to_string()))
    }

    /// Sequence parallelism splits the tokens of every sequence's norm / residual regions
    /// over tp ranks, so the sequence length must divide.
    pub fn check_seq(&self, seq: usize) -> Result<(), ParallelError> {
        if self.sp && !seq.is_multiple_of(self.tp) {
            return Err(ParallelError::Layout(format!(
                "sequence parallel: seq len {seq} is not divisible by tp = {}",
                self.tp
            )));
        }
        Ok(())
    }

    /// Part of a tensor with `parts` shards that rank `r` holds.
    pub fn part(&self, rank: usize, parts: usize) -> usize {
        rank * parts / self.tp
    }

    /// Whether rank `r` is the first holder of its part (counted once in global sums).
    pub fn owns(&self, rank: usize, split: Split) -> bool {
        rank.is_multiple_of(self.tp / split.parts())
    }

    /// Whether tp rank `rank` of this ep rank holds the counted copy of tensor `t`: its tp
    /// part's first holder, and for tensors replicated over the ep ranks the first of those.
    /// A tied copy is never the counted one.
    pub fn owns_tensor(&self, t: &TensorShard, rank: usize) -> bool {
        !t.tied_copy && self.owns(rank, t.split) && (t.experts.is_some() || self.ep_rank == 0)
    }

    /// The block of tensor `t`'s full view that rank `rank` holds, as a [`TensorSlice`]; its
    /// elements are the first `numel()` of the rank's local tensor (a vocabulary shard's
    /// padding rows follow them and are in no slice).
    pub fn slice(&self, t: &TensorShard, rank: usize) -> TensorSlice {
        let numel = t.full.numel();
        let shape = &t.full.shape;
        let part = self.part(rank, t.split.parts());
        let cols = *shape.last().expect("a tensor has a shape");
        let (lead, full_lead) = t.experts.map_or((0, None), |e| (e.lead, Some(e.full_lead)));
        let (view, offset, local) = match t.split {
            Split::Replicated => (shape.clone(), vec![0; shape.len()], shape.clone()),
            Split::Rows { groups, parts } => {
                let full_groups = full_lead.unwrap_or(groups);
                let rows = numel / full_groups / cols;
                let n = rows / parts;
                (
                    vec![full_groups, rows, cols],
                    vec![lead, part * n, 0],
                    vec![groups, n, cols],
                )
            }
            Split::Cols { parts } => {
                let c = cols / parts;
                let local_rows = t.local.numel() / (cols / parts);
                (
                    vec![numel / cols, cols],
                    vec![lead, part * c],
                    vec![local_rows, c],
                )
            }
            Split::PaddedRows { rows, .. } => {
                let n = t.local.shape[0];
                let first = (part * n).min(rows);
                let real = n.min(rows - first);
                (vec![rows, cols], vec![first, 0], vec![real, cols])
            }
        };
        TensorSlice {
            name: t.name.clone(),
            shape: view,
            offset,
            local,
        }
    }

    /// Copies part `part` of a full tensor into `local` (`to_local`) or back.
    fn copy(t: &TensorShard, part: usize, full: &mut [f32], local: &mut [f32], to_local: bool) {
        let mv = |f: &mut [f32], l: &mut [f32]| {
            if to_local {
                l.copy_from_slice(f)
            } else {
                f.copy_from_slice(l)
            }
        };
        let (fv, lv) = (t.full.of_mut(full), t.local.of_mut(local));
        match t.split {
            Split::Replicated => mv(fv, lv),
            Split::Rows { groups, .. } => {
                let (lead, full_groups) = t.experts.map_or((0, groups), |e| (e.lead, e.full_lead));
                let n = lv.len() / groups;
                let group_len = fv.len() / full_groups;
                for (gi, l) in lv.chunks_mut(n).enumerate() {
                    let start = (lead + gi) * group_len + part * n;
                    mv(&mut fv[start..start + n], l);
                }
            }
            Split::PaddedRows { rows, .. } => {
                let cols = t.full.shape[1];
                let n = lv.len() / cols;
                let first = (part * n).min(rows);
                let real = n.min(rows - first);
                let (a, b) = (first * cols, (first + real) * cols);
                mv(&mut fv[a..b], &mut lv[..real * cols]);
                if to_local {
                    lv[real * cols..].fill(0.0);
                }
            }
            Split::Cols { parts } => {
                let cols = *t.full.shape.last().expect("matrix");
                let c = cols / parts;
                let lead = t.experts.map_or(0, |e| e.lead);
                for (f, l) in fv.chunks_mut(cols).skip(lead).zip(lv.chunks_mut(c)) {
                    mv(&mut f[part * c..(part + 1) * c], l);
                }
            }
        }
    }

    /// Rank `rank`'s shard of a full-layout buffer (parameters, or any per-parameter state).
    pub fn shard(&self, full: &[f32], rank: usize) -> Vec<f32> {
        let mut full = full.to_vec();
        let mut local = vec![0.0; self.local_layout.total()];
        for t in &self.tensors {
            let part = self.part(rank, t.split.parts());
            Self::copy(t, part, &mut full, &mut local, true);
        }
        local
    }

    /// The full-layout buffer from every rank's shard (rank order); each part is taken from
    /// its first holder (a tied copy from the embedding it copies).
    pub fn gather(&self, locals: &[Vec<f32>]) -> Result<Vec<f32>, ParallelError> {
        if locals.len() != self.tp || locals.iter().any(|l| l.len() != self.local_layout.total()) {
            return Err(ParallelError::Layout(format!(
                "gather needs {} shards of {} elements",
                self.tp,
                self.local_layout.total()
            )));
        }
        let mut full = vec![0.0; self.full_layout.total()];
        let mut locals = locals.to_vec();
        for t in &self.tensors {
            for (r, l) in locals.iter_mut().enumerate() {
                if self.owns(r, t.split) && !t.tied_copy {
                    Self::copy(t, self.part(r, t.split.parts()), &mut full, l, false);
                }
            }
        }
        Ok(full)
    }

    /// Sums every partial gradient over the ranks holding the same part (one all-reduce over
    /// the tp group of the full-size partial tensors; each rank adds into its part's slot).
    pub fn sync_grads(&self, group: &ProcessGroup, grads: &mut [f32]) -> Result<(), ParallelError> {
        self.sync_grads_in(group, grads, 0..self.local_layout.total())
    }

    /// [`Self::sync_grads`] for the tensors inside local flat `range`, with `grads` holding
    /// just that range (e.g. one unit).
    pub fn sync_grads_in(
        &self,
        group: &ProcessGroup,
        grads: &mut [f32],
        range: std::ops::Range<usize>,
    ) -> Result<(), ParallelError> {
        // Each partial tensor, re-based: `local` relative to `range`, `full` to its slot in
        // the reduction buffer.
        let mut at = 0;
        let partial: Vec<TensorShard> = self
            .tensors
            .iter()
            .filter(|t| {
                t.partial_grad && t.local.offset >= range.start && t.local.range().end <= range.end
            })
            .map(|t| {
                let s = TensorShard {
                    full: View {
                        offset: at,
                        shape: t.full.shape.clone(),
                    },
                    local: t.local.relative_to(range.start),
                    ..t.clone()
                };
                at += t.full.numel();
                s
            })
            .collect();
        if partial.is_empty() {
            return Ok(());
        }
        let rank = group.rank();
        let mut buf = vec![0.0f32; at];
        for t in &partial {
            Self::copy(t, self.part(rank, t.split.parts()), &mut buf, grads, false);
        }
        group.all_reduce(&mut buf, ReduceOp::Sum)?;
        for t in &partial {
            Self::copy(t, self.part(rank, t.split.parts()), &mut buf, grads, true);
        }
        Ok(())
    }
}
