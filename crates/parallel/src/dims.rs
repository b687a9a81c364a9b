//! The parallel degrees of a job and the one device mesh every process group is cut from.
//!
//! [`ParallelDims`] holds `pp, dp, cp, tp, ep` (plus the ZeRO stage, sequence parallelism and
//! virtual pipeline stages). [`ParallelDims::validate`] checks them against the world size and
//! the model, with errors that name the broken constraint, before any process group exists.
//!
//! World ranks are laid out on the mesh `[pp, dp, cp, tp]`, tp fastest-varying, so tensor-
//! parallel neighbours are consecutive ranks and share a host (Megatron's order
//! "tp-cp-ep-dp-pp"). Every group is a slice of it ([`Mesh`]): tp, cp, pp, dp, and dp×cp, the
//! group dense gradients are averaged over (context-parallel ranks see different tokens of
//! the same sequences). The expert view re-reads the same ranks as `[pp, edp, ep, tp]`: the
//! expert-parallel group is `ep` consecutive ranks of the flattened dp×cp index, and the
//! expert-data-parallel group (over which expert gradients are averaged) has `dp·cp/ep`.
use comm::{Communicator, DeviceMesh, ProcessGroup};
use model::ModelConfig;

use crate::data_parallel::ZeroStage;
use crate::ParallelError;

/// Degrees of parallelism of a job.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelDims {
    /// Pipeline stages.
    pub pp: usize,
    /// Data-parallel replicas.
    pub dp: usize,
    /// Context-parallel ranks per sequence.
    pub cp: usize,
    /// Tensor-parallel ranks per layer.
    pub tp: usize,
    /// Expert-parallel ranks (carved out of dp × cp).
    pub ep: usize,
    /// What data parallelism shards (ZeRO stage 0-3).
    pub zero: ZeroStage,
    /// Sequence parallelism inside the tp group.
    pub sp: bool,
    /// Pipeline stages per pipeline rank (interleaved schedules); 1 otherwise.
    pub virtual_stages: usize,
}

impl Default for ParallelDims {
    fn default() -> Self {
        ParallelDims {
            pp: 1,
            dp: 1,
            cp: 1,
            tp: 1,
            ep: 1,
            zero: ZeroStage::Ddp,
            sp: false,
            virtual_stages: 1,
        }
    }
}

fn bad<T>(msg: String) -> Result<T, ParallelError> {
    Err(ParallelError::Config(msg))
}

impl ParallelDims {
    /// Plain data parallelism over `dp` ranks at a ZeRO stage.
    pub fn data_parallel(dp: usize, zero: ZeroStage) -> Self {
        ParallelDims {
            dp,
            zero,
            ..Default::default()
        }
    }

    /// Ranks the mesh spans: `pp · dp · cp · tp`.
    pub fn world(&self) -> usize {
        self.pp * self.dp * self.cp * self.tp
    }

    /// The degrees as text, e.g. `pp=1 dp=2 cp=1 tp=2 ep=1 ZeRO-1 +sp`.
    pub fn describe(&self) -> String {
        format!(
            "pp={} dp={} cp={} tp={} ep={} ZeRO-{}{}{}",
            self.pp,
            self.dp,
            self.cp,
            self.tp,
            self.ep,
            self.zero.index(),
            if self.sp { " +sp" } else { "" },
            if self.virtual_stages > 1 {
                format!(" virtual={}", self.virtual_stages)
            } else {
                String::new()
            }
        )
    }

    /// Checks the degrees against each other and against `nproc` processes.
    pub fn validate(&self, nproc: usize) -> Result<(), ParallelError> {
        for (name, v) in [
            ("pp", self.pp),
            ("dp", self.dp),
            ("cp", self.cp),
            ("tp", self.tp),
            ("ep", self.ep),
            ("virtual pipeline stages", self.virtual_stages),
            ("nproc", nproc),
        ] {
            if v == 0 {
                return bad(format!("{name} must be at least 1"));
            }
        }
        if self.world() != nproc {
            return bad(format!(
                "nproc = {nproc} but pp × dp × cp × tp = {} × {} × {} × {} = {}: the mesh must cover every process",
                self.pp,
                self.dp,
                self.cp,
                self.tp,
                self.world()
            ));
        }
        if !(self.dp * self.cp).is_multiple_of(self.ep) {
            return bad(format!(
                "ep = {} must divide dp × cp = {}: expert parallelism is carved out of the data- and context-parallel ranks",
                self.ep,
                self.dp * self.cp
            ));
        }
        if self.sp && self.tp == 1 {
            return bad(
                "sequence parallelism splits tokens over the tensor-parallel group: it needs tp > 1"
                    .into(),
            );
        }
        if self.virtual_stages > 1 && self.pp == 1 {
            return bad("virtual pipeline stages need pp > 1".into());
        }
        Ok(())
    }

    /// Checks the degrees against the model and the training sequence length.
    pub fn validate_model(&self, m: &ModelConfig, seq_len: usize) -> Result<(), ParallelError> {
        let (tp, heads, kv) = (self.tp, m.num_attention_heads, m.kv_heads());
        if !heads.is_multiple_of(tp) {
            return bad(format!(
                "num_attention_heads = {heads} is not divisible by tp = {tp}"
            ));
        }
        if !(kv.is_multiple_of(tp) || tp.is_multiple_of(kv)) {
            return bad(format!(
                "num_key_value_heads = {kv} and tp = {tp}: one must divide the other (KV heads are split, or replicated evenly)"
            ));
        }
        let ffn = if m.is_moe() {
            m.expert_ffn()
        } else {
            m.intermediate_size
        };
        if !ffn.is_multiple_of(tp) {
            return bad(format!("ffn size {ffn} is not divisible by tp = {tp}"));
        }
        let stages = self.pp * self.virtual_stages;
        if stages > m.num_hidden_layers {
            return bad(format!(
                "pp × virtual stages = {stages} exceeds num_hidden_layers = {}: every pipeline stage needs a layer",
                m.num_hidden_layers
            ));
        }
        if self.ep > 1 && !m.is_moe() {
            return bad(format!(
                "ep = {} but the model has no experts (a dense model has nothing to shard over ep)",
                self.ep
            ));
        }
        if m.is_moe() && !m.num_local_experts.is_multiple_of(self.ep) {
            return bad(format!(
                "num_local_experts = {} is not divisible by ep = {}",
                m.num_local_experts, self.ep
            ));
        }
        if !seq_len.is_multiple_of(self.cp) {
            return bad(format!(
                "seq_len = {seq_len} is not divisible by cp = {}",
                self.cp
            ));
        }
        if self.sp && !(seq_len / self.cp).is_multiple_of(tp) {
            return bad(format!(
                "sequence parallel: seq_len / cp = {} is not divisible by tp = {tp}",
                seq_len / self.cp
            ));
        }
        Ok(())
    }
}

/// The mesh `[pp, dp, cp, tp]` over a communicator and the groups cut from it (created on
/// first use, collectively by their members, and cached).
pub struct Mesh {
    dims: ParallelDims,
    comm: Communicator,
    mesh: DeviceMesh,
    /// The expert view `[pp, edp, ep, tp]` of the same ranks.
    expert: DeviceMesh,
}

impl Mesh {
    /// Lays `comm`'s world out on `dims` (validated first).
    pub fn new(comm: &Communicator, dims: ParallelDims) -> Result<Self, ParallelError> {
        dims.validate(comm.size())?;
        let mesh = DeviceMesh::new(
            comm,
            &[
                ("pp", dims.pp),
                ("dp", dims.dp),
                ("cp", dims.cp),
                ("tp", dims.tp),
            ],
        )?;
        let expert = DeviceMesh::new(
            comm,
            &[
                ("pp", dims.pp),
                ("edp", dims.dp * dims.cp / dims.ep),
                ("ep", dims.ep),
                ("tp", dims.tp),
            ],
        )?;
        Ok(Mesh {
            dims,
            comm: comm.clone(),
            mesh,
            expert,
        })
    }

    pub fn dims(&self) -> &ParallelDims {
        &self.dims
    }

    /// The world communicator the mesh lays out (for groups beyond the mesh's slices, such
    /// as the pipeline's links).
    pub fn comm(&self) -> &Communicator {
        &self.comm
    }

    /// This rank's coordinate along `pp`, `dp`, `cp` or `tp`.
    pub fn coord(&self, dim: &str) -> Result<usize, ParallelError> {
        Ok(self.mesh.coord(dim)?)
    }

    pub fn tp(&self) -> Result<ProcessGroup, ParallelError> {
        Ok(self.mesh.group(&["tp"])?)
    }
    pub fn cp(&self) -> Result<ProcessGroup, ParallelError> {
        Ok(self.mesh.group(&["cp"])?)
    }
    pub fn pp(&self) -> Result<ProcessGroup, ParallelError> {
        Ok(self.mesh.group(&["pp"])?)
    }
    pub fn dp(&self) -> Result<ProcessGroup, ParallelError> {
        Ok(self.mesh.group(&["dp"])?)
    }
    /// The group dense gradients are averaged over: dp × cp.
    pub fn dp_cp(&self) -> Result<ProcessGroup, ParallelError> {
        Ok(self.mesh.group(&["dp", "cp"])?)
    }
    /// The dp × cp group widened over the pp ranks `replicas` (those holding the same layers
    /// as this rank, itself included): the same dp, cp and tp coordinates at each of them.
    /// Just [`Self::dp_cp`] when this rank's layers have no other holder.
    pub fn dp_cp_with_replicas(&self, replicas: &[usize]) -> Result<ProcessGroup, ParallelError> {
        if replicas.len() <= 1 {
            return self.dp_cp();
        }
        let shape = self.mesh.shape();
        let mut ranks = Vec::new();
        for w in shape.group_ranks(&["dp", "cp"], self.comm.rank())? {
            let mut c = shape.coords(w);
            for &q in replicas {
                c[0] = q; // the pp coordinate
                ranks.push(shape.rank_of(&c));
            }
        }
        ranks.sort_unstable();
        Ok(self.comm.new_named_group("dp-replicas", &ranks)?)
    }
    /// The expert-parallel group (`ep` consecutive ranks of dp × cp).
    pub fn ep(&self) -> Result<ProcessGroup, ParallelError> {
        Ok(self.expert.group(&["ep"])?)
    }
    /// The ranks holding parts of the same layers under expert and tensor parallelism
    /// (`ep × tp`): sums over a stage's parts (gradient norms) run over it.
    pub fn expert_parts(&self) -> Result<ProcessGroup, ParallelError> {
        Ok(self.expert.group(&["ep", "tp"])?)
    }
    /// The group expert gradients are averaged over (`dp·cp/ep` ranks).
    pub fn edp(&self) -> Result<ProcessGroup, ParallelError> {
        Ok(self.expert.group(&["edp"])?)
    }
    /// The group a model replica spans (pp × cp × tp): every rank that holds a part of one copy
    /// of the parameters or sees a part of one sample.
    pub fn replica(&self) -> Result<ProcessGroup, ParallelError> {
        Ok(self.mesh.group(&["pp", "cp", "tp"])?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use comm::MeshShape;

    fn dims(pp: usize, dp: usize, cp: usize, tp: usize, ep: usize) -> ParallelDims {
        ParallelDims {
            pp,
            dp,
            cp,
            tp,
            ep,
            ..Default::default()
        }
    }

    #[test]
    fn world_and_constraints() {
        assert!(dims(2, 2, 1, 2, 1).validate(8).is_ok());
        let e = dims(1, 2, 1, 2, 1).validate(3).unwrap_err().to_string();
        assert!(e.contains("nproc = 3") && e.contains("= 4"), "{e}");
        let e = dims(1, 2, 1, 1, 4).validate(2).unwrap_err().to_string();
        assert!(e.contains("ep = 4 must divide dp × cp = 2"), "{e}");
        let mut d = dims(1, 2, 1, 1, 1);
        d.sp = true;
        assert!(d.validate(2).unwrap_err().to_string().contains("tp > 1"));
        let e = dims(0, 1, 1, 1, 1).validate(1).unwrap_err().to_string();
        assert!(e.contains("pp must be at least 1"), "{e}");
    }

    #[test]
    fn model_constraints_name_the_culprit() {
        let llama = ModelConfig::llama(64, 32, 48, 2, 4, 2);
        let moe = llama.clone().with_experts(4, 2);
        let err = |d: ParallelDims, m: &ModelConfig, seq: usize| {
            d.validate_model(m, seq).unwrap_err().to_string()
        };
        assert!(err(dims(1, 1, 1, 3, 1), &llama, 8).contains("num_attention_heads = 4"));
        assert!(dims(1, 1, 1, 4, 1).validate_model(&llama, 8).is_ok());
        assert!(err(dims(3, 1, 1, 1, 1), &llama, 8).contains("exceeds num_hidden_layers = 2"));
        assert!(err(dims(1, 2, 1, 1, 2), &llama, 8).contains("no experts"));
        assert!(err(dims(1, 3, 1, 1, 3), &moe, 8).contains("num_local_experts = 4"));
        assert!(err(dims(1, 1, 3, 1, 1), &llama, 8).contains("seq_len = 8"));
        let mut d = dims(1, 1, 1, 4, 1);
        d.sp = true;
        assert!(err(d, &llama, 6).contains("not divisible by tp = 4"));
        let mut f = llama.clone();
        f.intermediate_size = 50;
        assert!(err(dims(1, 1, 1, 4, 1), &f, 8).contains("ffn size 50"));
    }

    #[test]
    fn expert_view_carves_ep_out_of_dp_cp() {
        // [pp, dp, cp, tp] = [1, 2, 2, 2] and ep = 2: the expert view [pp, edp, ep, tp].
        let d = dims(1, 2, 2, 2, 2);
        let main = MeshShape::new(&[("pp", 1), ("dp", 2), ("cp", 2), ("tp", 2)]).unwrap();
        let expert = MeshShape::new(&[
            ("pp", 1),
            ("edp", d.dp * d.cp / d.ep),
            ("ep", d.ep),
            ("tp", 2),
        ])
        .unwrap();
        // dp×cp of rank 0: ranks 0, 2, 4, 6; ep takes consecutive pairs of them, edp the rest.
        assert_eq!(main.group_ranks(&["dp", "cp"], 0).unwrap(), [0, 2, 4, 6]);
        assert_eq!(expert.group_ranks(&["ep"], 0).unwrap(), [0, 2]);
        assert_eq!(expert.group_ranks(&["edp"], 0).unwrap(), [0, 4]);
        assert_eq!(expert.group_ranks(&["ep"], 5).unwrap(), [5, 7]);
        // Both views keep the tp groups.
        assert_eq!(
            main.all_groups(&["tp"]).unwrap(),
            expert.all_groups(&["tp"]).unwrap()
        );
    }
}
