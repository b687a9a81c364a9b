//! Flat parameter layout: every tensor of the model (Hugging Face name, shape, offset) in one
//! fixed order inside one contiguous buffer. Blocks are contiguous, so a transformer block is a
//! single range (a ZeRO-3 gather unit, a pipeline stage slice, a DDP bucket boundary).
//!
//! Order: `model.embed_tokens.weight`, then each block
//! (`input_layernorm`, `q/k/v/o_proj`, `post_attention_layernorm`, MLP or MoE tensors),
//! then `model.norm.weight` and `lm_head.weight` (absent when embeddings are tied).

use std::ops::Range;

use crate::config::ModelConfig;

/// A typed view into a flat buffer: where a tensor starts and its shape (row-major).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct View {
    pub offset: usize,
    pub shape: Vec<usize>,
}

impl View {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    pub fn range(&self) -> Range<usize> {
        self.offset..self.offset + self.numel()
    }
    /// The slice of `buf` this view covers.
    pub fn of<'a>(&self, buf: &'a [f32]) -> &'a [f32] {
        &buf[self.range()]
    }
    /// The mutable slice of `buf` this view covers.
    pub fn of_mut<'a>(&self, buf: &'a mut [f32]) -> &'a mut [f32] {
        &mut buf[self.range()]
    }
    /// The range of `buf` this view covers, on the buffer's device.
    pub fn at<'a>(&self, buf: tensor::buf::BufRef<'a>) -> tensor::buf::BufRef<'a> {
        buf.slice(self.range())
    }
    /// The mutable range of `buf` this view covers, on the buffer's device.
    pub fn at_mut<'a>(&self, buf: tensor::buf::BufMut<'a>) -> tensor::buf::BufMut<'a> {
        buf.slice_mut(self.range())
    }
    /// The same view shifted by `-base` (absolute offset -> offset relative to a range start).
    pub fn relative_to(&self, base: usize) -> View {
        View {
            offset: self.offset - base,
            shape: self.shape.clone(),
        }
    }
}

/// What kind of parameter a tensor is (used by init and by optimizer parameter groups).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// A weight matrix or embedding table: normal(0, initializer_range) init.
    Matrix,
    /// An RMSNorm gain: initialised to ones.
    NormGain,
}

/// One tensor of the layout.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamEntry {
    /// Hugging Face name, e.g. `model.layers.0.self_attn.q_proj.weight`.
    pub name: String,
    pub view: View,
    pub kind: ParamKind,
}

/// The layout of all parameters of a model in one flat buffer.
#[derive(Debug, Clone, PartialEq)]
pub struct ParamLayout {
    pub entries: Vec<ParamEntry>,
    embed: Range<usize>,
    blocks: Vec<Range<usize>>,
    head: Range<usize>,
    total: usize,
}

struct Builder {
    entries: Vec<ParamEntry>,
    offset: usize,
}

impl Builder {
    fn push(&mut self, name: String, shape: Vec<usize>, kind: ParamKind) {
        let view = View {
            offset: self.offset,
            shape,
        };
        self.offset += view.numel();
        self.entries.push(ParamEntry { name, view, kind });
    }
}

impl ParamLayout {
    /// Build the layout of `cfg` (which should be validated).
    pub fn new(cfg: &ModelConfig) -> Self {
        use ParamKind::*;
        let h = cfg.hidden_size;
        let d = cfg.head_dim();
        let (hq, hkv) = (cfg.num_attention_heads, cfg.kv_heads());
        let mut b = Builder {
            entries: Vec::new(),
            offset: 0,
        };
        b.push(
            "model.embed_tokens.weight".into(),
            vec![cfg.vocab_size, h],
            Matrix,
        );
        let embed = 0..b.offset;
        let mut blocks = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let start = b.offset;
            let p = format!("model.layers.{l}.");
            b.push(format!("{p}input_layernorm.weight"), vec![h], NormGain);
            b.push(
                format!("{p}self_attn.q_proj.weight"),
                vec![hq * d, h],
                Matrix,
            );
            b.push(
                format!("{p}self_attn.k_proj.weight"),
                vec![hkv * d, h],
                Matrix,
            );
            b.push(
                format!("{p}self_attn.v_proj.weight"),
                vec![hkv * d, h],
                Matrix,
            );
            b.push(
                format!("{p}self_attn.o_proj.weight"),
                vec![h, hq * d],
                Matrix,
            );
            b.push(
                format!("{p}post_attention_layernorm.weight"),
                vec![h],
                NormGain,
            );
            if cfg.is_moe() {
                // The router scores every expert; the stacked expert weights hold the
                // instance's experts (all of them but under expert parallelism).
                let (e, f) = (cfg.num_local_experts, cfg.expert_ffn());
                let held = cfg.held_experts().1;
                b.push(format!("{p}mlp.gate.weight"), vec![e, h], Matrix);
                b.push(
                    format!("{p}mlp.experts.gate_up_proj"),
                    vec![held, 2 * f, h],
                    Matrix,
                );
                b.push(
                    format!("{p}mlp.experts.down_proj"),
                    vec![held, h, f],
                    Matrix,
                );
                let s = cfg.shared_ffn();
                if s > 0 {
                    b.push(
                        format!("{p}mlp.shared_expert.gate_proj.weight"),
                        vec![s, h],
                        Matrix,
                    );
                    b.push(
                        format!("{p}mlp.shared_expert.up_proj.weight"),
                        vec![s, h],
                        Matrix,
                    );
                    b.push(
                        format!("{p}mlp.shared_expert.down_proj.weight"),
                        vec![h, s],
                        Matrix,
                    );
                }
            } else {
                let f = cfg.intermediate_size;
                b.push(format!("{p}mlp.gate_proj.weight"), vec![f, h], Matrix);
                b.push(format!("{p}mlp.up_proj.weight"), vec![f, h], Matrix);
                b.push(format!("{p}mlp.down_proj.weight"), vec![h, f], Matrix);
            }
            blocks.push(start..b.offset);
        }
        let head_start = b.offset;
        b.push("model.norm.weight".into(), vec![h], NormGain);
        if !cfg.tie_word_embeddings {
            b.push("lm_head.weight".into(), vec![cfg.vocab_size, h], Matrix);
        }
        let head = head_start..b.offset;
        ParamLayout {
            entries: b.entries,
            embed,
            blocks,
            head,
            total: b.offset,
        }
    }

    /// Total number of parameters (length of the flat buffer).
    pub fn total(&self) -> usize {
        self.total
    }
    /// Range of the embedding table.
    pub fn embed_range(&self) -> Range<usize> {
        self.embed.clone()
    }
    /// Range of block `i` (all its tensors, contiguous).
    pub fn block_range(&self, i: usize) -> Range<usize> {
        self.blocks[i].clone()
    }
    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }
    /// Range of the final norm and the LM head (just the norm when embeddings are tied).
    pub fn head_range(&self) -> Range<usize> {
        self.head.clone()
    }
    /// The model's parts in order, as flat ranges: embedding, each block, head (the units a
    /// data-parallel or pipeline engine schedules).
    pub fn part_ranges(&self) -> Vec<Range<usize>> {
        let mut out = vec![self.embed_range()];
        out.extend(self.blocks.iter().cloned());
        out.push(self.head_range());
        out
    }
    /// Every tensor's flat range, in buffer order.
    pub fn tensor_ranges(&self) -> Vec<Range<usize>> {
        let mut t: Vec<_> = self.entries.iter().map(|e| e.view.range()).collect();
        t.sort_by_key(|r| r.start);
        t
    }
    /// Look a tensor up by its HF name.
    pub fn get(&self, name: &str) -> Option<&ParamEntry> {
        self.entries.iter().find(|e| e.name == name)
    }
    /// AdamW parameter groups over `range` (e.g. a ZeRO shard), as segments relative to
    /// `range.start`: matrices get `weight_decay`, norm gains `norm_decay` (torch recipes
    /// commonly use 0 there; the HF golden run decays everything). Pass the result to
    /// [`crate::optim::AdamW::step_segments`].
    pub fn decay_segments(
        &self,
        range: Range<usize>,
        weight_decay: f32,
        norm_decay: f32,
    ) -> Vec<(Range<usize>, f32)> {
        let mut out: Vec<(Range<usize>, f32)> = Vec::new();
        for e in &self.entries {
            let r = e.view.range();
            let (s, t) = (r.start.max(range.start), r.end.min(range.end));
            if s >= t {
                continue;
            }
            let wd = match e.kind {
                ParamKind::Matrix => weight_decay,
                ParamKind::NormGain => norm_decay,
            };
            let seg = s - range.start..t - range.start;
            match out.last_mut() {
                Some((last, lwd)) if *lwd == wd && last.end == seg.start => last.end = seg.end,
                _ => out.push((seg, wd)),
            }
        }
        out
    }

    /// The entries whose data lies inside `range` (e.g. one block).
    pub fn entries_in(&self, range: Range<usize>) -> impl Iterator<Item = &ParamEntry> {
        self.entries
            .iter()
            .filter(move |e| e.view.offset >= range.start && e.view.range().end <= range.end)
    }
}
