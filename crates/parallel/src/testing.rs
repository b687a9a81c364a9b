//! A tiny model for the executor's tests: token embedding, `L` residual tanh-MLP blocks, and a
//! softmax cross-entropy head, each a unit with hand-written forward, input-gradient and
//! weight-gradient passes.
//!
//! `y = x + tanh(x W + b)` per block; loss = mean over the micro-batch of `-log softmax(x H)[t]`.
//! It is small enough that every configuration of the parity suite runs in milliseconds, and
//! its units have different sizes so buckets and shards cut across them. [`ToyModel::stage`]
//! gives a pipeline stage's view: a run of the units over its own flat buffer.
use std::ops::Range;

use crate::placement::{Placement, TensorSlice};
use crate::stage::StageModel;
use crate::ParallelError;
use tensor::buf::{Buf, BufMut, BufRef};

#[derive(Clone, Debug)]
pub struct ToyModel {
    pub vocab: usize,
    pub dim: usize,
    pub blocks: usize,
    pub classes: usize,
    /// Sleep this long in every block's weight gradient (to make the overlap visible in a
    /// trace).
    pub backward_delay: std::time::Duration,
    /// The (global) units this instance holds, in order: all, or a pipeline rank's stages.
    pub held: Vec<usize>,
}

/// One sample: an input token and a target class.
pub type Sample = (usize, usize);

pub enum ToyCache {
    Embed(Vec<usize>),
    Block {
        x: Vec<f32>,
        h: Vec<f32>,
    },
    Head {
        x: Vec<f32>,
        probs: Vec<f32>,
        targets: Vec<usize>,
    },
}

/// What a unit's weight gradient needs.
pub enum ToyWeightGrad {
    Embed { tokens: Vec<usize>, dy: Vec<f32> },
    Block { x: Vec<f32>, dz: Vec<f32> },
    Head { x: Vec<f32>, dl: Vec<f32> },
}

impl ToyModel {
    pub fn new(vocab: usize, dim: usize, blocks: usize, classes: usize) -> Self {
        Self {
            vocab,
            dim,
            blocks,
            classes,
            backward_delay: std::time::Duration::ZERO,
            held: (0..blocks + 2).collect(),
        }
    }

    /// The view holding global units `units` only (a pipeline rank's stages).
    pub fn stage(&self, units: &[usize]) -> Self {
        Self {
            held: units.to_vec(),
            ..self.clone()
        }
    }

    /// Sizes of every global unit.
    fn global_sizes(&self) -> Vec<usize> {
        let mut out = vec![self.vocab * self.dim];
        out.extend((0..self.blocks).map(|_| self.dim * self.dim + self.dim));
        out.push(self.dim * self.classes);
        out
    }

    /// Parameters of the whole model (all units).
    pub fn num_params(&self) -> usize {
        self.global_sizes().iter().sum()
    }

    /// Deterministic small initial parameters of the whole model.
    pub fn init(&self, seed: u64) -> Vec<f32> {
        let mut s = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..self.num_params())
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.8
            })
            .collect()
    }

    /// The part of [`Self::init`] this view holds.
    pub fn init_held(&self, seed: u64) -> Vec<f32> {
        let sizes = self.global_sizes();
        let full = self.init(seed);
        self.held
            .iter()
            .flat_map(|&g| {
                let start: usize = sizes[..g].iter().sum();
                full[start..start + sizes[g]].to_vec()
            })
            .collect()
    }

    /// Deterministic samples `[start, start + n)` of an endless stream.
    pub fn samples(&self, start: usize, n: usize) -> Vec<Sample> {
        (start..start + n)
            .map(|i| {
                let h = (i as u64).wrapping_mul(0x9E3779B97F4A7C15) >> 33;
                (
                    (h % self.vocab as u64) as usize,
                    ((h / 7) % self.classes as u64) as usize,
                )
            })
            .collect()
    }

    /// The loss and the full gradient of `params` on `batch` (one process, every unit in
    /// order, then backward): the reference the parallel runs are compared with.
    pub fn loss_and_grads(
        &self,
        params: &[f32],
        batch: &<Self as StageModel>::Batch,
    ) -> (f32, Vec<f32>) {
        let units = self.units();
        let (mut x, mut caches) = (None, Vec::new());
        for (u, r) in units.iter().enumerate() {
            let (y, c) = self
                .forward(u, (&params[r.clone()]).into(), x.take(), batch, 1.0)
                .expect("toy forward");
            caches.push(c);
            x = Some(y);
        }
        let loss = self.loss(x.as_ref().expect("a model has units"));
        let mut g = vec![0.0; params.len()];
        let mut dy = None;
        for (u, r) in units.iter().enumerate().rev() {
            dy = self
                .backward(
                    u,
                    (&params[r.clone()]).into(),
                    caches.pop().expect("one cache per unit"),
                    dy.take(),
                    1.0,
                    (&mut g[r.clone()]).into(),
                )
                .expect("toy backward");
        }
        (loss, g)
    }

    fn global(&self, unit: usize) -> usize {
        self.held[unit]
    }
}

fn rows(batch: usize, x: &[f32], dim: usize) -> Result<(), ParallelError> {
    if x.len() != batch * dim {
        return Err(ParallelError::Model(format!(
            "activation has {} values, expected {batch}x{dim}",
            x.len()
        )));
    }
    Ok(())
}

/// The toy model runs on host buffers only.
fn host(p: BufRef<'_>) -> Result<&[f32], ParallelError> {
    p.as_host("the toy model")
        .map_err(|e| ParallelError::Model(e.to_string()))
}

impl StageModel for ToyModel {
    type Batch = Vec<Sample>;
    type Act = Vec<f32>;
    type Cache = ToyCache;
    type WeightGrad = ToyWeightGrad;

    fn units(&self) -> Vec<Range<usize>> {
        let sizes = self.global_sizes();
        let mut out = Vec::with_capacity(self.held.len());
        let mut at = 0;
        for &g in &self.held {
            out.push(at..at + sizes[g]);
            at += sizes[g];
        }
        out
    }

    fn tensors(&self) -> Vec<Range<usize>> {
        self.placements().iter().map(|p| p.range()).collect()
    }

    fn placements(&self) -> Vec<Placement> {
        let (d, units) = (self.dim, self.units());
        let mut out = Vec::new();
        let mut push = |name: String, shape: &[usize], start: usize| {
            out.push(Placement {
                slice: TensorSlice::whole(&name, shape),
                start,
                owner: true,
            })
        };
        for (u, r) in units.iter().enumerate() {
            let g = self.global(u);
            if g == 0 {
                push("embed".into(), &[self.vocab, d], r.start);
            } else if g <= self.blocks {
                push(format!("block{g}.w"), &[d, d], r.start);
                push(format!("block{g}.b"), &[d], r.start + d * d);
            } else {
                push("head".into(), &[d, self.classes], r.start);
            }
        }
        out
    }

    fn is_first(&self, unit: usize) -> bool {
        self.global(unit) == 0
    }

    fn is_last(&self, unit: usize) -> bool {
        self.global(unit) == self.blocks + 1
    }

    fn forward(
        &self,
        unit: usize,
        p: BufRef<'_>,
        x: Option<Vec<f32>>,
        batch: &Vec<Sample>,
        _scale: f32,
    ) -> Result<(Vec<f32>, ToyCache), ParallelError> {
        let p = host(p)?;
        let (d, n, g) = (self.dim, batch.len(), self.global(unit));
        if g == 0 {
            let mut y = vec![0.0; n * d];
            for (i, &(tok, _)) in batch.iter().enumerate() {
                if tok >= self.vocab {
                    return Err(ParallelError::Model(format!(
                        "token {tok} outside vocabulary {}",
                        self.vocab
                    )));
                }
                y[i * d..(i + 1) * d].copy_from_slice(&p[tok * d..(tok + 1) * d]);
            }
            return Ok((y, ToyCache::Embed(batch.iter().map(|s| s.0).collect())));
        }
        let x = x.ok_or_else(|| ParallelError::Model(format!("unit {unit} needs an input")))?;
        rows(n, &x, d)?;
        if g <= self.blocks {
            let (w, b) = p.split_at(d * d);
            let mut h = vec![0.0; n * d];
            for i in 0..n {
                for j in 0..d {
                    let z: f32 = b[j] + (0..d).map(|k| x[i * d + k] * w[k * d + j]).sum::<f32>();
                    h[i * d + j] = z.tanh();
                }
            }
            let y = x.iter().zip(&h).map(|(a, b)| a + b).collect();
            return Ok((y, ToyCache::Block { x, h }));
        }
        let c = self.classes;
        let mut probs = vec![0.0; n * c];
        let mut loss = 0.0;
        for i in 0..n {
            let logits: Vec<f32> = (0..c)
                .map(|j| (0..d).map(|k| x[i * d + k] * p[k * c + j]).sum())
                .collect();
            let mx = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = logits.iter().map(|l| (l - mx).exp()).sum();
            for j in 0..c {
                probs[i * c + j] = (logits[j] - mx).exp() / z;
            }
            let t = batch[i].1;
            if t >= c {
                return Err(ParallelError::Model(format!(
                    "target {t} outside {c} classes"
                )));
            }
            loss += -(logits[t] - mx - z.ln());
        }
        let targets = batch.iter().map(|s| s.1).collect();
        Ok((vec![loss / n as f32], ToyCache::Head { x, probs, targets }))
    }

    fn backward_input(
        &self,
        unit: usize,
        p: BufRef<'_>,
        cache: ToyCache,
        dy: Option<Vec<f32>>,
        scale: f32,
    ) -> Result<(Option<Vec<f32>>, ToyWeightGrad), ParallelError> {
        let p = host(p)?;
        let d = self.dim;
        let need = |dy: Option<Vec<f32>>| {
            dy.ok_or_else(|| ParallelError::Model(format!("unit {unit} backward needs dY")))
        };
        match cache {
            ToyCache::Embed(tokens) => Ok((
                None,
                ToyWeightGrad::Embed {
                    tokens,
                    dy: need(dy)?,
                },
            )),
            ToyCache::Block { x, h } => {
                let dy = need(dy)?;
                let n = x.len() / d;
                let w = &p[..d * d];
                let dz: Vec<f32> = dy.iter().zip(&h).map(|(g, h)| g * (1.0 - h * h)).collect();
                let mut dx = dy;
                for i in 0..n {
                    for j in 0..d {
                        let dzij = dz[i * d + j];
                        for k in 0..d {
                            dx[i * d + k] += dzij * w[k * d + j];
                        }
                    }
                }
                Ok((Some(dx), ToyWeightGrad::Block { x, dz }))
            }
            ToyCache::Head { x, probs, targets } => {
                let (c, n) = (self.classes, targets.len());
                let mut dx = vec![0.0; n * d];
                let mut dl = vec![0.0; n * c];
                for i in 0..n {
                    for j in 0..c {
                        let g = (probs[i * c + j] - f32::from(j == targets[i])) * scale / n as f32;
                        dl[i * c + j] = g;
                        for k in 0..d {
                            dx[i * d + k] += g * p[k * c + j];
                        }
                    }
                }
                Ok((Some(dx), ToyWeightGrad::Head { x, dl }))
            }
        }
    }

    fn backward_weight(
        &self,
        _unit: usize,
        _p: BufRef<'_>,
        pending: ToyWeightGrad,
        g: BufMut<'_>,
    ) -> Result<(), ParallelError> {
        let g = g
            .as_host("the toy model")
            .map_err(|e| ParallelError::Model(e.to_string()))?;
        let d = self.dim;
        match pending {
            ToyWeightGrad::Embed { tokens, dy } => {
                for (i, &tok) in tokens.iter().enumerate() {
                    for k in 0..d {
                        g[tok * d + k] += dy[i * d + k];
                    }
                }
            }
            ToyWeightGrad::Block { x, dz } => {
                if !self.backward_delay.is_zero() {
                    std::thread::sleep(self.backward_delay);
                }
                let n = x.len() / d;
                let (gw, gb) = g.split_at_mut(d * d);
                for i in 0..n {
                    for j in 0..d {
                        let dzij = dz[i * d + j];
                        gb[j] += dzij;
                        for k in 0..d {
                            gw[k * d + j] += x[i * d + k] * dzij;
                        }
                    }
                }
            }
            ToyWeightGrad::Head { x, dl } => {
                let (c, n) = (self.classes, x.len() / d);
                for i in 0..n {
                    for j in 0..c {
                        for k in 0..d {
                            g[k * c + j] += x[i * d + k] * dl[i * c + j];
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn loss(&self, out: &Vec<f32>) -> f32 {
        out[0]
    }

    fn cache_bytes(&self, cache: &ToyCache) -> usize {
        match cache {
            ToyCache::Embed(t) => t.len() * 8,
            ToyCache::Block { x, h } => (x.len() + h.len()) * 4,
            ToyCache::Head { x, probs, targets } => (x.len() + probs.len()) * 4 + targets.len() * 8,
        }
    }

    fn weight_grad_bytes(&self, w: &ToyWeightGrad) -> usize {
        match w {
            ToyWeightGrad::Embed { tokens, dy } => tokens.len() * 8 + dy.len() * 4,
            ToyWeightGrad::Block { x, dz } => (x.len() + dz.len()) * 4,
            ToyWeightGrad::Head { x, dl } => (x.len() + dl.len()) * 4,
        }
    }

    fn act_to_wire(&self, act: Vec<f32>) -> Result<Buf, ParallelError> {
        Ok(Buf::Host(act))
    }

    fn wire_to_act(&self, wire: Buf) -> Result<Vec<f32>, ParallelError> {
        Ok(wire.into_host("a toy model's activation")?)
    }

    fn wire_len(&self, batch: &Vec<Sample>) -> usize {
        batch.len() * self.dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Finite-difference check of the hand-written backward (f64 not needed: the loss is O(1)).
    #[test]
    fn backward_matches_finite_differences() {
        let m = ToyModel::new(5, 3, 2, 4);
        let mut p = m.init(1);
        let batch = m.samples(0, 3);
        let loss_and_grad = |p: &[f32]| m.loss_and_grads(p, &batch);
        let (_, g) = loss_and_grad(&p);
        let h = 1e-2f32;
        for i in (0..p.len()).step_by(3) {
            let orig = p[i];
            p[i] = orig + h;
            let lp = loss_and_grad(&p).0;
            p[i] = orig - h;
            let lm = loss_and_grad(&p).0;
            p[i] = orig;
            let fd = (lp - lm) / (2.0 * h);
            assert!(
                (fd - g[i]).abs() < 2e-3,
                "param {i}: fd {fd} vs backward {}",
                g[i]
            );
        }
    }

    #[test]
    fn stages_split_units_and_parameters() {
        let m = ToyModel::new(5, 3, 2, 4);
        let (a, b) = (m.stage(&[0, 1]), m.stage(&[2, 3]));
        assert!(a.is_first(0) && !a.is_last(1) && b.is_last(1) && !b.is_first(0));
        let full = m.init(7);
        let joined: Vec<f32> = a.init_held(7).into_iter().chain(b.init_held(7)).collect();
        assert_eq!(joined, full);
        assert_eq!(
            a.placements().len() + b.placements().len(),
            m.placements().len()
        );
    }
}
