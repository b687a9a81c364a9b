//! Model configuration with Hugging Face `config.json` field names (Llama and Mixtral), the
//! presets the trainer uses, and validation that rejects impossible shapes with a clear error.

use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

fn default_eps() -> f32 {
    1e-6
}
fn default_theta() -> f32 {
    10000.0
}
fn default_top_k() -> usize {
    2
}
fn default_aux_coef() -> f32 {
    0.001
}
fn default_init_range() -> f32 {
    0.02
}
fn default_max_pos() -> usize {
    4096
}

/// Decoder configuration. Field names are those of Hugging Face `LlamaConfig` /
/// `MixtralConfig`, so a `config.json` deserialises directly; unknown fields are ignored.
///
/// A model is a mixture of experts when `num_local_experts > 0`. Extensions beyond Mixtral
/// (all optional, absent in HF files): `moe_intermediate_size` (expert FFN width, defaults to
/// `intermediate_size`), `shared_expert_intermediate_size` (a dense SwiGLU expert every token
/// passes through, added to the routed output), and `capacity_factor` (drop assignments beyond
/// `ceil(capacity_factor * tokens * top_k / experts)` per expert; `None` = dropless).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Defaults to `num_attention_heads` (multi-head attention) when absent.
    #[serde(default)]
    pub num_key_value_heads: Option<usize>,
    /// Defaults to `hidden_size / num_attention_heads` when absent.
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "default_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// RoPE frequency scaling (`rope_scaling`; transformers 5 writes it, with `rope_theta`,
    /// as `rope_parameters`, which [`ModelConfig::from_json_str`] reads too). Only
    /// `rope_type = "llama3"` is implemented: any other type is refused, never ignored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    /// Std of the normal initialisation of every matrix (HF `initializer_range`).
    #[serde(default = "default_init_range")]
    pub initializer_range: f32,
    /// Number of routed experts; 0 = dense Llama MLP.
    #[serde(default)]
    pub num_local_experts: usize,
    #[serde(default = "default_top_k")]
    pub num_experts_per_tok: usize,
    /// HF semantics: the auxiliary load-balancing loss is added to the loss only when
    /// `output_router_logits` is true, scaled by `router_aux_loss_coef`.
    #[serde(default)]
    pub output_router_logits: bool,
    #[serde(default = "default_aux_coef")]
    pub router_aux_loss_coef: f32,
    #[serde(default)]
    pub moe_intermediate_size: Option<usize>,
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<usize>,
    #[serde(default)]
    pub capacity_factor: Option<f32>,
    /// Which assignments an expert over capacity keeps: `"position"` (the first in token
    /// order, the default) or `"probability"` (the most probable, Switch Transformer's
    /// priority). Not a Hugging Face field.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_drop: Option<String>,
    /// Auxiliary-loss-free load balancing (DeepSeek-V3): a per-expert bias added to the
    /// router's probabilities when choosing the top-k (not to the weights), kept by the
    /// trainer. Not a Hugging Face field.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub router_bias: bool,
    /// Expert parallelism: the experts this model instance holds (the router still scores
    /// all `num_local_experts`). Not part of the Hugging Face config; `None`: all of them.
    #[serde(skip)]
    pub expert_shard: Option<ExpertShard>,
}

/// Hugging Face's `rope_scaling` object. The fields are those of the `llama3` type (the only
/// one implemented); `type` is the older spelling of `rope_type`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeScaling {
    #[serde(alias = "type")]
    pub rope_type: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub factor: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub low_freq_factor: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub high_freq_factor: Option<f32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub original_max_position_embeddings: Option<usize>,
}

impl RopeScaling {
    /// Llama 3's scaling with the given constants.
    pub fn llama3(factor: f32, low: f32, high: f32, original: usize) -> Self {
        RopeScaling {
            rope_type: "llama3".into(),
            factor: Some(factor),
            low_freq_factor: Some(low),
            high_freq_factor: Some(high),
            original_max_position_embeddings: Some(original),
        }
    }

    /// The scaling as the rotary kernel takes it, or why it cannot be.
    pub fn to_llama3(&self) -> std::result::Result<tensor::rope::Llama3Scaling, String> {
        if self.rope_type != "llama3" {
            return Err(format!(
                "rope_scaling of type `{}` is not supported (only `llama3` is)",
                self.rope_type
            ));
        }
        let need = |v: Option<f32>, name: &str| {
            v.ok_or_else(|| format!("rope_scaling of type llama3 needs `{name}`"))
        };
        Ok(tensor::rope::Llama3Scaling {
            factor: need(self.factor, "factor")?,
            low_freq_factor: need(self.low_freq_factor, "low_freq_factor")?,
            high_freq_factor: need(self.high_freq_factor, "high_freq_factor")?,
            original_max_position_embeddings: self
                .original_max_position_embeddings
                .ok_or("rope_scaling of type llama3 needs `original_max_position_embeddings`")?,
        })
    }
}

/// A contiguous range of a MoE layer's experts (expert parallelism).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpertShard {
    pub first: usize,
    pub count: usize,
}

impl ModelConfig {
    /// A dense Llama config with the given sizes and HF defaults elsewhere.
    pub fn llama(
        vocab: usize,
        hidden: usize,
        ffn: usize,
        layers: usize,
        heads: usize,
        kv_heads: usize,
    ) -> Self {
        ModelConfig {
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: ffn,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: Some(kv_heads),
            head_dim: None,
            rms_norm_eps: 1e-5,
            rope_theta: 10000.0,
            tie_word_embeddings: false,
            rope_scaling: None,
            max_position_embeddings: default_max_pos(),
            initializer_range: 0.02,
            num_local_experts: 0,
            num_experts_per_tok: default_top_k(),
            output_router_logits: false,
            router_aux_loss_coef: default_aux_coef(),
            moe_intermediate_size: None,
            shared_expert_intermediate_size: None,
            capacity_factor: None,
            capacity_drop: None,
            router_bias: false,
            expert_shard: None,
        }
    }

    /// The experts this instance holds: `(first, count)` of `num_local_experts`.
    pub fn held_experts(&self) -> (usize, usize) {
        self.expert_shard
            .map_or((0, self.num_local_experts), |s| (s.first, s.count))
    }

    /// Turn this config into a Mixtral-style MoE with `experts` experts, `top_k` per token.
    pub fn with_experts(mut self, experts: usize, top_k: usize) -> Self {
        self.num_local_experts = experts;
        self.num_experts_per_tok = top_k;
        self
    }

    /// Named presets used by the trainer and the benchmarks: `tiny`, `small`, `medium`
    /// (dense) and `tiny-moe` (tiny with 4 experts, top-2).
    pub fn preset(name: &str) -> Result<Self> {
        match name {
            "tiny" => Ok(Self::llama(256, 64, 176, 2, 4, 2)),
            "small" => Ok(Self::llama(256, 256, 688, 6, 8, 4)),
            "medium" => Ok(Self::llama(4096, 512, 1376, 8, 8, 4)),
            "tiny-moe" => Ok(Self::llama(256, 64, 176, 2, 4, 2).with_experts(4, 2)),
            other => Err(ModelError::InvalidConfig(format!(
                "unknown preset `{other}` (known: tiny, small, medium, tiny-moe)"
            ))),
        }
    }

    /// Parse a HF `config.json` text and validate it.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let parse = |e: serde_json::Error| ModelError::ConfigParse(e.to_string());
        let mut json: serde_json::Value = serde_json::from_str(text).map_err(parse)?;
        // transformers 5: `rope_parameters = {rope_type, rope_theta, ...}` in place of
        // `rope_theta` and `rope_scaling` (type `default`: no scaling).
        if let Some(obj) = json.as_object_mut() {
            if let Some(mut rp) = obj.remove("rope_parameters").filter(|v| v.is_object()) {
                let rp_obj = rp.as_object_mut().expect("checked to be an object");
                if let Some(theta) = rp_obj.remove("rope_theta") {
                    obj.insert("rope_theta".into(), theta);
                }
                let kind = rp_obj.get("rope_type").or_else(|| rp_obj.get("type"));
                if kind.and_then(|k| k.as_str()) != Some("default")
                    && !obj.get("rope_scaling").is_some_and(|v| v.is_object())
                {
                    obj.insert("rope_scaling".into(), rp);
                }
            }
            // `rope_scaling: null` is what configs without scaling often say.
            if obj.get("rope_scaling").is_some_and(|v| v.is_null()) {
                obj.remove("rope_scaling");
            }
        }
        let cfg: ModelConfig = serde_json::from_value(json).map_err(parse)?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Read and validate a HF `config.json` file.
    pub fn from_json_file(path: &std::path::Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json_str(&text)
    }

    /// Serialise to HF-style JSON.
    pub fn to_json_string(&self) -> String {
        serde_json::to_string_pretty(self).expect("config serialises")
    }

    /// The rotary embedding of this config: `rope_theta`, scaled by `rope_scaling`.
    pub fn rope(&self) -> std::result::Result<tensor::rope::Rope, String> {
        let rope =
            tensor::rope::Rope::new(self.head_dim(), self.rope_theta).map_err(|e| e.to_string())?;
        match &self.rope_scaling {
            None => Ok(rope),
            Some(s) => rope.with_llama3(&s.to_llama3()?).map_err(|e| e.to_string()),
        }
    }

    pub fn kv_heads(&self) -> usize {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or_else(|| self.hidden_size / self.num_attention_heads.max(1))
    }

    pub fn is_moe(&self) -> bool {
        self.num_local_experts > 0
    }

    /// Width of each routed expert's FFN.
    pub fn expert_ffn(&self) -> usize {
        self.moe_intermediate_size.unwrap_or(self.intermediate_size)
    }

    /// Width of the shared expert (0 = none).
    pub fn shared_ffn(&self) -> usize {
        self.shared_expert_intermediate_size.unwrap_or(0)
    }

    /// Coefficient of the auxiliary load-balancing loss actually added to the loss.
    pub fn effective_aux_coef(&self) -> f32 {
        if self.is_moe() && self.output_router_logits {
            self.router_aux_loss_coef
        } else {
            0.0
        }
    }

    /// Check that the configuration describes a buildable model.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(ModelError::InvalidConfig(m));
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.kv_heads()),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return bad(format!("{name} must be > 0"));
            }
        }
        if self.head_dim.is_none() && !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return bad(format!(
                "hidden_size {} is not divisible by num_attention_heads {}",
                self.hidden_size, self.num_attention_heads
            ));
        }
        if self.head_dim() == 0 {
            return bad("head_dim must be > 0".into());
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be even for rotary embeddings",
                self.head_dim()
            ));
        }
        if !self.num_attention_heads.is_multiple_of(self.kv_heads()) {
            return bad(format!(
                "num_attention_heads {} is not divisible by num_key_value_heads {}",
                self.num_attention_heads,
                self.kv_heads()
            ));
        }
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps.is_finite()) {
            return bad(format!("rms_norm_eps {} must be > 0", self.rms_norm_eps));
        }
        if !(self.rope_theta > 0.0 && self.rope_theta.is_finite()) {
            return bad(format!("rope_theta {} must be > 0", self.rope_theta));
        }
        if let Some(r) = &self.rope_scaling {
            self.rope()
                .map_err(|e| ModelError::InvalidConfig(format!("{e} ({r:?})")))?;
        }
        if !(self.initializer_range >= 0.0 && self.initializer_range.is_finite()) {
            return bad("initializer_range must be finite and >= 0".into());
        }
        if self.is_moe() {
            if self.num_experts_per_tok == 0 {
                return bad("num_experts_per_tok must be > 0".into());
            }
            if self.num_experts_per_tok > self.num_local_experts {
                return bad(format!(
                    "num_experts_per_tok {} exceeds num_local_experts {}",
                    self.num_experts_per_tok, self.num_local_experts
                ));
            }
            if let Some(sh) = self.expert_shard {
                if sh.count == 0 || sh.first + sh.count > self.num_local_experts {
                    return bad(format!(
                        "expert shard {}..{} of {} experts",
                        sh.first,
                        sh.first + sh.count,
                        self.num_local_experts
                    ));
                }
            }
            if self.expert_ffn() == 0 {
                return bad("moe_intermediate_size must be > 0".into());
            }
            if let Some(d) = &self.capacity_drop {
                if d != "position" && d != "probability" {
                    return bad(format!(
                        "capacity_drop `{d}` (expected position or probability)"
                    ));
                }
            }
            if let Some(cf) = self.capacity_factor {
                if !(cf > 0.0 && cf.is_finite()) {
                    return bad(format!("capacity_factor {cf} must be > 0"));
                }
            }
            if !(self.router_aux_loss_coef >= 0.0 && self.router_aux_loss_coef.is_finite()) {
                return bad("router_aux_loss_coef must be finite and >= 0".into());
            }
        } else if self.shared_expert_intermediate_size.is_some() || self.capacity_factor.is_some() {
            return bad("shared expert / capacity_factor need num_local_experts > 0".into());
        }
        Ok(())
    }
}
