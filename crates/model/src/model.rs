//! The decoder as a whole: embedding, blocks, final norm + LM head + cross-entropy over one flat
//! parameter buffer. Each part is exposed separately (taking just its own parameter range), so
//! pipeline / ZeRO-3 executors drive the model block by block; `forward_backward` is the
//! single-process convenience, reporting each range as soon as its gradients are final.

use std::ops::Range;
use std::sync::Arc;

use tensor::cross_entropy::{CeConfig, IGNORE_INDEX};

use crate::config::ModelConfig;
use crate::documents::Documents;
use crate::error::{ModelError, Result};
use crate::layers::attention::Attention;
use crate::layers::block::{Block, BlockCache, Ffn};
use crate::layers::head::{Head, HeadCache, HeadWeightGrad};
use crate::layers::mlp::SwiGlu;
use crate::layers::moe::Moe;
use crate::layers::{Act, Buf, BufMut, BufRef, Pass, Recompute, WeightGradStore};
use crate::layout::{ParamLayout, View};
use crate::profile::{time, Kernel};

/// A micro-batch of token ids `[batch, seq]` and next-token targets (`IGNORE_INDEX` = no loss),
/// with the document boundaries of its rows when attention is masked per document.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    pub batch: usize,
    pub seq: usize,
    pub inputs: Vec<u32>,
    pub targets: Vec<i64>,
    /// Block-causal attention over these documents ([`Batch::with_documents`]); `None`:
    /// causal attention over whole rows.
    pub docs: Option<Arc<Documents>>,
}

impl Batch {
    /// A batch from explicit inputs and targets (both `[batch, seq]`).
    pub fn new(batch: usize, seq: usize, inputs: Vec<u32>, targets: Vec<i64>) -> Result<Self> {
        if batch == 0 || seq == 0 {
            return Err(ModelError::InvalidBatch("batch and seq must be > 0".into()));
        }
        if inputs.len() != batch * seq || targets.len() != batch * seq {
            return Err(ModelError::InvalidBatch(format!(
                "expected {} inputs and targets, got {} and {}",
                batch * seq,
                inputs.len(),
                targets.len()
            )));
        }
        Ok(Batch {
            batch,
            seq,
            inputs,
            targets,
            docs: None,
        })
    }

    /// This batch with attention masked to `docs` (which must be `[batch, seq]`).
    pub fn with_documents(mut self, docs: Documents) -> Result<Self> {
        docs.check(self.batch, self.seq)?;
        self.docs = Some(Arc::new(docs));
        Ok(self)
    }

    /// Causal-LM batch from rows of `ids` (`[batch, seq]`): position `t` predicts `ids[t+1]` of
    /// the same row; the last position of each row has no target (the HF golden convention).
    pub fn next_token(batch: usize, seq: usize, ids: &[u32]) -> Result<Self> {
        if ids.len() != batch * seq {
            return Err(ModelError::InvalidBatch(format!(
                "expected {} ids, got {}",
                batch * seq,
                ids.len()
            )));
        }
        let mut targets = vec![IGNORE_INDEX; ids.len()];
        for b in 0..batch {
            for t in 0..seq.saturating_sub(1) {
                targets[b * seq + t] = ids[b * seq + t + 1] as i64;
            }
        }
        Self::new(batch, seq, ids.to_vec(), targets)
    }

    /// A packed causal-LM batch: rows of `ids` cut into `docs`, each token predicting the next
    /// token of its own document, the last token of each document nothing. Every document is
    /// then trained exactly as if it were a row of its own ([`Batch::next_token`]).
    pub fn next_token_per_document(ids: &[u32], docs: Documents) -> Result<Self> {
        let (batch, seq) = (docs.batch(), docs.seq());
        let mut b = Self::next_token(batch, seq, ids)?;
        for (row, start, len) in docs.spans() {
            b.targets[row * seq + start + len - 1] = IGNORE_INDEX;
        }
        b.with_documents(docs)
    }

    pub fn tokens(&self) -> usize {
        self.batch * self.seq
    }
}

/// Options of a whole-model step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOptions {
    pub recompute: Recompute,
    /// Multiplies every gradient (e.g. `1 / accumulation_steps`).
    pub loss_scale: f32,
}

impl Default for StepOptions {
    fn default() -> Self {
        StepOptions {
            recompute: Recompute::None,
            loss_scale: 1.0,
        }
    }
}

/// Losses of one micro-batch.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossReport {
    /// `ce + aux`: what the gradients differentiate (before `loss_scale`).
    pub loss: f32,
    /// Mean cross-entropy over valid targets.
    pub ce: f32,
    /// Weighted MoE auxiliary loss summed over blocks (0 when off).
    pub aux: f32,
    /// Number of valid targets.
    pub n_valid: usize,
}

/// A Llama / Mixtral-style decoder over a flat parameter buffer laid out by [`ParamLayout`].
#[derive(Debug, Clone)]
pub struct Model {
    pub cfg: ModelConfig,
    pub layout: ParamLayout,
    /// Block layers; their views are relative to `layout.block_range(i)`.
    pub blocks: Vec<Block>,
    /// Final norm + CE; its views are relative to `layout.head_range()`.
    pub head: Head,
    /// `lm_head.weight` relative to the head range (`None` when tied to the embedding).
    lm_head: Option<View>,
}

fn view(layout: &ParamLayout, name: &str, base: usize) -> View {
    layout
        .get(name)
        .unwrap_or_else(|| panic!("layout has {name}"))
        .view
        .relative_to(base)
}

/// Slice views of expert `e` out of the fused `[E, 2F, H]` / `[E, H, F]` tensors.
fn expert_views(gate_up: &View, down: &View, e: usize) -> SwiGlu {
    let (f2, h) = (gate_up.shape[1], gate_up.shape[2]);
    let f = f2 / 2;
    let base = gate_up.offset + e * f2 * h;
    SwiGlu {
        gate: View {
            offset: base,
            shape: vec![f, h],
        },
        up: View {
            offset: base + f * h,
            shape: vec![f, h],
        },
        down: View {
            offset: down.offset + e * h * f,
            shape: vec![h, f],
        },
    }
}

impl Model {
    /// Build the model for a config (validated here).
    pub fn new(cfg: ModelConfig) -> Result<Self> {
        cfg.validate()?;
        let layout = ParamLayout::new(&cfg);
        let rope = Arc::new(cfg.rope().map_err(ModelError::InvalidConfig)?);
        let layers = cfg.num_hidden_layers;
        let blocks = (0..layers)
            .map(|l| {
                let base = layout.block_range(l).start;
                let p = format!("model.layers.{l}.");
                let v = |n: &str| view(&layout, &format!("{p}{n}"), base);
                let ffn = if cfg.is_moe() {
                    let gate_up = v("mlp.experts.gate_up_proj");
                    let down = v("mlp.experts.down_proj");
                    Ffn::Moe(Moe {
                        router: v("mlp.gate.weight"),
                        experts: (0..cfg.held_experts().1)
                            .map(|e| expert_views(&gate_up, &down, e))
                            .collect(),
                        first_expert: cfg.held_experts().0,
                        exchange: None,
                        shared: (cfg.shared_ffn() > 0).then(|| SwiGlu {
                            gate: v("mlp.shared_expert.gate_proj.weight"),
                            up: v("mlp.shared_expert.up_proj.weight"),
                            down: v("mlp.shared_expert.down_proj.weight"),
                        }),
                        top_k: cfg.num_experts_per_tok,
                        capacity_factor: cfg.capacity_factor,
                        drop_by_probability: cfg.capacity_drop.as_deref() == Some("probability"),
                        bias: cfg.router_bias.then(|| {
                            Arc::new(std::sync::RwLock::new(vec![0.0; cfg.num_local_experts]))
                        }),
                        aux_coef: cfg.effective_aux_coef() / layers as f32,
                        seq_group: None,
                    })
                } else {
                    Ffn::Dense(SwiGlu {
                        gate: v("mlp.gate_proj.weight"),
                        up: v("mlp.up_proj.weight"),
                        down: v("mlp.down_proj.weight"),
                    })
                };
                Block {
                    attn_norm: v("input_layernorm.weight"),
                    attn: Attention {
                        wq: v("self_attn.q_proj.weight"),
                        wk: v("self_attn.k_proj.weight"),
                        wv: v("self_attn.v_proj.weight"),
                        wo: v("self_attn.o_proj.weight"),
                        n_heads: cfg.num_attention_heads,
                        n_kv_heads: cfg.kv_heads(),
                        head_dim: cfg.head_dim(),
                        rope: rope.clone(),
                        core: None,
                    },
                    ffn_norm: v("post_attention_layernorm.weight"),
                    ffn,
                    eps: cfg.rms_norm_eps,
                    hooks: None,
                }
            })
            .collect();
        let hb = layout.head_range().start;
        let head = Head {
            norm: view(&layout, "model.norm.weight", hb),
            vocab: cfg.vocab_size,
            eps: cfg.rms_norm_eps,
            ce: CeConfig::for_vocab(cfg.vocab_size),
        };
        let lm_head = (!cfg.tie_word_embeddings).then(|| view(&layout, "lm_head.weight", hb));
        Ok(Model {
            cfg,
            layout,
            blocks,
            head,
            lm_head,
        })
    }

    /// Number of parameters (length of the flat buffers).
    pub fn num_params(&self) -> usize {
        self.layout.total()
    }

    /// Deterministically initialised parameters for `seed`.
    /// Every layer's router balancing bias (empty for layers without one).
    pub fn router_biases(&self) -> Vec<Vec<f32>> {
        self.blocks
            .iter()
            .map(|b| match &b.ffn {
                Ffn::Moe(m) => m.bias.as_ref().map_or(Vec::new(), |x| {
                    x.read().unwrap_or_else(|e| e.into_inner()).clone()
                }),
                _ => Vec::new(),
            })
            .collect()
    }

    /// Sets the router balancing biases (one per layer, as [`Self::router_biases`] gives).
    pub fn set_router_biases(&self, biases: &[Vec<f32>]) -> Result<()> {
        if biases.len() != self.blocks.len() {
            return Err(ModelError::InvalidConfig(format!(
                "{} router biases for {} layers",
                biases.len(),
                self.blocks.len()
            )));
        }
        for (b, new) in self.blocks.iter().zip(biases) {
            if let Ffn::Moe(m) = &b.ffn {
                if let Some(x) = &m.bias {
                    let mut x = x.write().unwrap_or_else(|e| e.into_inner());
                    if new.len() != x.len() {
                        return Err(ModelError::InvalidConfig(format!(
                            "a router bias of {} experts for {}",
                            new.len(),
                            x.len()
                        )));
                    }
                    x.copy_from_slice(new);
                }
            }
        }
        Ok(())
    }

    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        let mut p = vec![0.0; self.layout.total()];
        crate::init::init_params(&self.layout, self.cfg.initializer_range, seed, &mut p);
        p
    }

    /// Elements `range` of [`Self::init_params`]'s buffer, written into `out` without building
    /// the whole buffer (bit for bit the same values; see [`crate::init::init_range`]).
    pub fn init_range(&self, seed: u64, range: std::ops::Range<usize>, out: &mut [f32]) {
        crate::init::init_range(&self.layout, self.cfg.initializer_range, seed, range, out);
    }

    fn check_len(&self, what: &'static str, len: usize) -> Result<()> {
        if len != self.layout.total() {
            return Err(ModelError::BufferSize {
                what,
                expected: self.layout.total(),
                found: len,
            });
        }
        Ok(())
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.cfg.vocab_size) {
            return Err(ModelError::InvalidBatch(format!(
                "token id {bad} out of range for vocab_size {}",
                self.cfg.vocab_size
            )));
        }
        Ok(())
    }

    /// Embedding lookup: `p_embed` is the embedding range, output `[tokens, hidden]` on its
    /// device.
    pub fn embed_forward<'a1>(&self, p_embed: impl Into<BufRef<'a1>>, ids: &[u32]) -> Result<Buf> {
        let p_embed: BufRef<'_> = p_embed.into();
        self.check_ids(ids)?;
        let h = self.cfg.hidden_size;
        Ok(time(Kernel::Embedding, || {
            tensor::ops::embedding_forward(ids, p_embed, h, None)
        })?)
    }

    /// Embedding backward: scatter-add `dx` into the embedding-range gradient `g_embed`.
    pub fn embed_backward<'a1, 'a2>(
        &self,
        g_embed: impl Into<BufMut<'a2>>,
        ids: &[u32],
        dx: impl Into<BufRef<'a1>>,
    ) -> Result<()> {
        let g_embed: BufMut<'_> = g_embed.into();
        let dx: BufRef<'_> = dx.into();
        time(Kernel::Embedding, || {
            tensor::ops::embedding_backward(ids, dx, self.cfg.hidden_size, None, g_embed)
        })?;
        Ok(())
    }

    /// Forward of block `i` with its parameter range `p_block`.
    pub fn block_forward<'a1>(
        &self,
        i: usize,
        p_block: impl Into<BufRef<'a1>>,
        x: Act,
        pass: &Pass,
    ) -> Result<(Buf, BlockCache)> {
        let p_block: BufRef<'_> = p_block.into();
        self.blocks[i].forward(p_block, x, pass)
    }

    /// Input gradient of block `i`; its weight gradients stay in the returned store.
    pub fn block_backward_input<'a1>(
        &self,
        i: usize,
        p_block: impl Into<BufRef<'a1>>,
        cache: BlockCache,
        dy: Buf,
    ) -> Result<(Buf, WeightGradStore)> {
        let p_block: BufRef<'_> = p_block.into();
        self.blocks[i].backward_input(p_block, cache, dy)
    }

    /// Weight gradients of block `i`, accumulated into its gradient range `g_block`.
    pub fn block_backward_weight<'a1>(
        &self,
        i: usize,
        store: WeightGradStore,
        g_block: impl Into<BufMut<'a1>>,
    ) -> Result<()> {
        let g_block: BufMut<'_> = g_block.into();
        self.blocks[i].backward_weight(store, g_block)
    }

    /// The LM-head weight: `lm_head.weight` inside the head range, or the tied embedding.
    fn lm<'a>(&self, p_head: BufRef<'a>, p_embed: BufRef<'a>) -> BufRef<'a> {
        match &self.lm_head {
            Some(v) => v.at(p_head),
            None => p_embed,
        }
    }

    /// Final norm + LM head + CE forward. `p_embed` is only read when embeddings are tied
    /// (pass an empty range otherwise).
    pub fn head_forward<'a1, 'a2>(
        &self,
        p_head: impl Into<BufRef<'a1>>,
        p_embed: impl Into<BufRef<'a2>>,
        x: Act,
        targets: Arc<Vec<i64>>,
    ) -> Result<HeadCache> {
        let p_head: BufRef<'_> = p_head.into();
        let p_embed: BufRef<'_> = p_embed.into();
        self.head
            .forward(p_head, self.lm(p_head, p_embed), x, targets)
    }

    /// [`Model::head_forward`] that also computes the head's gradients of
    /// `grad_scale · loss_sum` in the same pass over the logits (see `layers::head`);
    /// [`Model::head_backward`] / [`Model::head_backward_input`] called with the same scale
    /// then reuse them instead of recomputing the logits.
    pub fn head_forward_with_grad<'a1, 'a2>(
        &self,
        p_head: impl Into<BufRef<'a1>>,
        p_embed: impl Into<BufRef<'a2>>,
        x: Act,
        targets: Arc<Vec<i64>>,
        grad_scale: f32,
    ) -> Result<HeadCache> {
        let p_head: BufRef<'_> = p_head.into();
        let p_embed: BufRef<'_> = p_embed.into();
        self.head
            .forward_with_grad(p_head, self.lm(p_head, p_embed), x, targets, grad_scale)
    }

    /// Head backward for `grad_scale · loss_sum` (use `loss_scale / n_valid` for a mean):
    /// returns `dx`, accumulates the norm and LM-head gradients into `g_head` (and into
    /// `g_embed` when embeddings are tied).
    pub fn head_backward<'a1, 'a2, 'a3>(
        &self,
        p_head: impl Into<BufRef<'a1>>,
        p_embed: impl Into<BufRef<'a2>>,
        g_head: impl Into<BufMut<'a3>>,
        g_embed: Option<BufMut<'_>>,
        cache: HeadCache,
        grad_scale: f32,
    ) -> Result<Buf> {
        let p_head: BufRef<'_> = p_head.into();
        let p_embed: BufRef<'_> = p_embed.into();
        let g_head: BufMut<'_> = g_head.into();
        let lm = self.lm(p_head, p_embed);
        let (g_norm, g_lm) = self.split_head_grads(g_head, g_embed)?;
        self.head
            .backward(p_head, lm, cache, grad_scale, g_norm, g_lm)
    }

    /// Head input gradient only (zero-bubble `B` for the last stage); the norm and LM-head
    /// weight gradients are deferred to [`Model::head_backward_weight`].
    pub fn head_backward_input<'a1, 'a2>(
        &self,
        p_head: impl Into<BufRef<'a1>>,
        p_embed: impl Into<BufRef<'a2>>,
        cache: HeadCache,
        grad_scale: f32,
    ) -> Result<(Buf, HeadWeightGrad)> {
        let p_head: BufRef<'_> = p_head.into();
        let p_embed: BufRef<'_> = p_embed.into();
        self.head
            .backward_input(p_head, self.lm(p_head, p_embed), cache, grad_scale)
    }

    /// Deferred head weight gradients, accumulated like [`Model::head_backward`].
    pub fn head_backward_weight<'a1, 'a2, 'a3>(
        &self,
        p_head: impl Into<BufRef<'a1>>,
        p_embed: impl Into<BufRef<'a2>>,
        g_head: impl Into<BufMut<'a3>>,
        g_embed: Option<BufMut<'_>>,
        pending: HeadWeightGrad,
    ) -> Result<()> {
        let p_head: BufRef<'_> = p_head.into();
        let p_embed: BufRef<'_> = p_embed.into();
        let g_head: BufMut<'_> = g_head.into();
        let lm = self.lm(p_head, p_embed);
        let (g_norm, g_lm) = self.split_head_grads(g_head, g_embed)?;
        self.head.backward_weight(lm, pending, g_norm, g_lm)
    }

    /// The norm-gain and LM-head gradient ranges for the head.
    fn split_head_grads<'a>(
        &self,
        g_head: BufMut<'a>,
        g_embed: Option<BufMut<'a>>,
    ) -> Result<(BufMut<'a>, BufMut<'a>)> {
        let h = self.cfg.hidden_size;
        let (g_norm, g_rest) = g_head.split_at_mut(h);
        let g_lm = match (&self.lm_head, g_embed) {
            (Some(v), _) => g_rest.slice_mut(v.offset - h..v.offset - h + v.numel()),
            (None, Some(g)) => g,
            (None, None) => {
                return Err(ModelError::InvalidBatch(
                    "tied embeddings: the head backward needs the embedding gradient".into(),
                ))
            }
        };
        Ok((g_norm, g_lm))
    }

    /// Full logits `[batch·seq, vocab]` for token ids `[batch, seq]` (no gradient), on the
    /// host whatever the device of `params`.
    pub fn logits<'a>(
        &self,
        params: impl Into<BufRef<'a>>,
        ids: &[u32],
        batch: usize,
        seq: usize,
    ) -> Result<Vec<f32>> {
        let params = params.into();
        self.check_len("params", params.len())?;
        if ids.len() != batch * seq {
            return Err(ModelError::InvalidBatch(format!(
                "expected {} ids, got {}",
                batch * seq,
                ids.len()
            )));
        }
        self.logits_pass(params, ids, &Pass::new(batch, seq))
    }

    /// [`Model::logits`] of a batch's inputs, under its document mask if it has one.
    pub fn logits_of<'a>(&self, params: impl Into<BufRef<'a>>, batch: &Batch) -> Result<Vec<f32>> {
        let pass = Pass::new(batch.batch, batch.seq).with_documents(batch.docs.clone());
        self.logits_pass(params.into(), &batch.inputs, &pass)
    }

    fn logits_pass(&self, params: BufRef<'_>, ids: &[u32], pass: &Pass) -> Result<Vec<f32>> {
        self.check_len("params", params.len())?;
        let pass = pass.clone();
        let mut x = self.embed_forward(params.slice(self.layout.embed_range()), ids)?;
        for (i, b) in self.blocks.iter().enumerate() {
            x = b
                .forward(params.slice(self.layout.block_range(i)), Arc::new(x), &pass)?
                .0;
        }
        let ph = params.slice(self.layout.head_range());
        let pe = params.slice(self.layout.embed_range());
        Ok(self.head.logits(ph, self.lm(ph, pe), x.r())?.to_vec()?)
    }

    /// Forward through every layer; with `loss_scale`, the head also computes its gradients
    /// of `loss_scale ×` the mean loss ([`Model::head_forward_with_grad`]).
    fn forward_all(
        &self,
        params: BufRef<'_>,
        batch: &Batch,
        pass: &Pass,
        loss_scale: Option<f32>,
    ) -> Result<(Vec<BlockCache>, HeadCache)> {
        self.check_len("params", params.len())?;
        let mut x = self.embed_forward(params.slice(self.layout.embed_range()), &batch.inputs)?;
        let mut caches = Vec::with_capacity(self.blocks.len());
        for (i, b) in self.blocks.iter().enumerate() {
            let (y, c) = b.forward(params.slice(self.layout.block_range(i)), Arc::new(x), pass)?;
            caches.push(c);
            x = y;
        }
        let (ph, pe) = (
            params.slice(self.layout.head_range()),
            params.slice(self.layout.embed_range()),
        );
        let (x, targets) = (Arc::new(x), Arc::new(batch.targets.clone()));
        let head = match loss_scale {
            None => self.head_forward(ph, pe, x, targets)?,
            Some(ls) => {
                let s = self.head.mean_grad_scale(&targets, ls)?;
                self.head_forward_with_grad(ph, pe, x, targets, s)?
            }
        };
        Ok((caches, head))
    }

    fn report(caches: &[BlockCache], head: &HeadCache) -> LossReport {
        let ce = if head.n_valid == 0 {
            0.0
        } else {
            (head.loss_sum / head.n_valid as f64) as f32
        };
        let aux: f32 = caches.iter().map(BlockCache::aux_loss).sum();
        LossReport {
            loss: ce + aux,
            ce,
            aux,
            n_valid: head.n_valid,
        }
    }

    /// Forward only: the losses of `batch` (parameters on the host or a GPU).
    pub fn forward_loss<'a>(
        &self,
        params: impl Into<BufRef<'a>>,
        batch: &Batch,
    ) -> Result<LossReport> {
        let pass = Pass::new(batch.batch, batch.seq).with_documents(batch.docs.clone());
        let (caches, head) = self.forward_all(params.into(), batch, &pass, None)?;
        Ok(Self::report(&caches, &head))
    }

    /// Forward and backward of one micro-batch: gradients of `loss_scale · (ce + aux)` are
    /// accumulated (`+=`) into `grads` (on the device of `params`). `on_grads_ready(range)` is
    /// called as soon as the gradients of a parameter range are final for this micro-batch:
    /// the head range, then blocks from last to first, then the embedding (DDP launches
    /// bucket reductions there).
    pub fn forward_backward<'a, 'b>(
        &self,
        params: impl Into<BufRef<'a>>,
        grads: impl Into<BufMut<'b>>,
        batch: &Batch,
        opts: &StepOptions,
        on_grads_ready: &mut dyn FnMut(Range<usize>),
    ) -> Result<LossReport> {
        let (params, grads) = (params.into(), grads.into());
        self.check_len("grads", grads.len())?;
        let mut pass = Pass::new(batch.batch, batch.seq)
            .with_recompute(opts.recompute)
            .with_documents(batch.docs.clone());
        pass.loss_scale = opts.loss_scale;
        // The head's gradient scale (a mean over this batch's valid targets) is known before
        // the head's forward, so the head computes its gradients in that pass.
        let (caches, head) = self.forward_all(params, batch, &pass, Some(opts.loss_scale))?;
        let report = Self::report(&caches, &head);
        let scale = if head.n_valid == 0 {
            0.0
        } else {
            opts.loss_scale / head.n_valid as f32
        };
        let (er, hr) = (self.layout.embed_range(), self.layout.head_range());
        // Embedding range comes first in the layout, the head range last.
        let (mut g_embed, g_rest) = grads.split_at_mut(er.end);
        let (mut g_mid, g_head) = g_rest.split_at_mut(hr.start - er.end);
        let tied = self.lm_head.is_none();
        let mut dx = self.head_backward(
            params.slice(hr.clone()),
            params.slice(er.clone()),
            g_head,
            tied.then(|| g_embed.reborrow()),
            head,
            scale,
        )?;
        on_grads_ready(hr);
        for (i, cache) in caches.into_iter().enumerate().rev() {
            let r = self.layout.block_range(i);
            let g = g_mid.reborrow().slice_mut(r.start - er.end..r.end - er.end);
            dx = self.blocks[i].backward(params.slice(r.clone()), g, cache, dx)?;
            on_grads_ready(r);
        }
        self.embed_backward(g_embed, &batch.inputs, dx.r())?;
        on_grads_ready(er);
        Ok(report)
    }
}
