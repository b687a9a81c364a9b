//! A tiny staged model for the engines' tests: token embedding, `L` residual tanh-MLP blocks,
//! and a softmax cross-entropy head, each a unit with hand-written forward and backward.
//!
//! `y = x + tanh(x W + b)` per block; loss = mean over the micro-batch of `-log softmax(x H)[t]`.
//! It is small enough that every configuration of the parity suite runs in milliseconds, and
//! its units have different sizes so buckets and shards cut across them.
use std::ops::Range;

use crate::staged::StagedModel;
use crate::ParallelError;

#[derive(Clone, Debug)]
pub struct ToyModel {
    pub vocab: usize,
    pub dim: usize,
    pub blocks: usize,
    pub classes: usize,
    /// Sleep this long in every block's backward (to make the overlap visible in a trace).
    pub backward_delay: std::time::Duration,
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

impl ToyModel {
    pub fn new(vocab: usize, dim: usize, blocks: usize, classes: usize) -> Self {
        Self {
            vocab,
            dim,
            blocks,
            classes,
            backward_delay: std::time::Duration::ZERO,
        }
    }

    pub fn num_params(&self) -> usize {
        self.units().last().map(|u| u.end).unwrap_or(0)
    }

    /// Deterministic small initial parameters.
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

impl StagedModel for ToyModel {
    type Batch = Vec<Sample>;
    type Act = Vec<f32>;
    type Cache = ToyCache;

    fn units(&self) -> Vec<Range<usize>> {
        let mut out = Vec::with_capacity(self.blocks + 2);
        out.push(0..self.vocab * self.dim);
        let block = self.dim * self.dim + self.dim;
        for _ in 0..self.blocks {
            let s = out.last().unwrap().end;
            out.push(s..s + block);
        }
        let s = out.last().unwrap().end;
        out.push(s..s + self.dim * self.classes);
        out
    }

    fn tensors(&self) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        for (i, u) in self.units().into_iter().enumerate() {
            if i == 0 || i == self.blocks + 1 {
                out.push(u);
            } else {
                let w = u.start + self.dim * self.dim;
                out.push(u.start..w);
                out.push(w..u.end);
            }
        }
        out
    }

    fn forward(
        &self,
        unit: usize,
        p: &[f32],
        x: Option<Vec<f32>>,
        batch: &Vec<Sample>,
        _scale: f32,
    ) -> Result<(Vec<f32>, ToyCache), ParallelError> {
        let (d, n) = (self.dim, batch.len());
        if unit == 0 {
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
        if unit <= self.blocks {
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

    fn loss(&self, out: &Vec<f32>) -> f32 {
        out[0]
    }

    fn backward(
        &self,
        unit: usize,
        p: &[f32],
        cache: ToyCache,
        dy: Option<Vec<f32>>,
        scale: f32,
        g: &mut [f32],
    ) -> Result<Option<Vec<f32>>, ParallelError> {
        let d = self.dim;
        match cache {
            ToyCache::Embed(tokens) => {
                let dy =
                    dy.ok_or_else(|| ParallelError::Model("embedding backward needs dY".into()))?;
                for (i, &tok) in tokens.iter().enumerate() {
                    for k in 0..d {
                        g[tok * d + k] += dy[i * d + k];
                    }
                }
                Ok(None)
            }
            ToyCache::Block { x, h } => {
                if !self.backward_delay.is_zero() {
                    std::thread::sleep(self.backward_delay);
                }
                let dy = dy.ok_or_else(|| {
                    ParallelError::Model(format!("block {unit} backward needs dY"))
                })?;
                let n = x.len() / d;
                let (w, _) = p.split_at(d * d);
                let (gw, gb) = g.split_at_mut(d * d);
                let dz: Vec<f32> = dy.iter().zip(&h).map(|(g, h)| g * (1.0 - h * h)).collect();
                let mut dx = dy.clone();
                for i in 0..n {
                    for j in 0..d {
                        let dzij = dz[i * d + j];
                        gb[j] += dzij;
                        for k in 0..d {
                            gw[k * d + j] += x[i * d + k] * dzij;
                            dx[i * d + k] += dzij * w[k * d + j];
                        }
                    }
                }
                Ok(Some(dx))
            }
            ToyCache::Head { x, probs, targets } => {
                let (c, n) = (self.classes, targets.len());
                let mut dx = vec![0.0; n * d];
                for i in 0..n {
                    for j in 0..c {
                        let dl = (probs[i * c + j] - f32::from(j == targets[i])) * scale / n as f32;
                        for k in 0..d {
                            g[k * c + j] += x[i * d + k] * dl;
                            dx[i * d + k] += dl * p[k * c + j];
                        }
                    }
                }
                Ok(Some(dx))
            }
        }
    }

    fn cache_bytes(&self, cache: &ToyCache) -> usize {
        match cache {
            ToyCache::Embed(t) => t.len() * 8,
            ToyCache::Block { x, h } => (x.len() + h.len()) * 4,
            ToyCache::Head { x, probs, targets } => (x.len() + probs.len()) * 4 + targets.len() * 8,
        }
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
        let loss_and_grad = |p: &[f32]| {
            let units = m.units();
            let mut x = None;
            let mut caches = Vec::new();
            for (u, r) in units.iter().enumerate() {
                let (y, c) = m.forward(u, &p[r.clone()], x.take(), &batch, 1.0).unwrap();
                caches.push(c);
                x = Some(y);
            }
            let loss = m.loss(x.as_ref().unwrap());
            let mut g = vec![0.0; p.len()];
            let mut dy = None;
            for (u, r) in units.iter().enumerate().rev() {
                dy = m
                    .backward(
                        u,
                        &p[r.clone()],
                        caches.pop().unwrap(),
                        dy.take(),
                        1.0,
                        &mut g[r.clone()],
                    )
                    .unwrap();
            }
            (loss, g)
        };
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
}
