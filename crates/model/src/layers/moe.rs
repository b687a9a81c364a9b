//! Mixtral-style mixture of experts: a softmax router over all experts, top-k selection with the
//! k weights renormalised to sum to one, SwiGLU experts, an optional shared expert, optional
//! capacity (assignments beyond capacity are dropped, in token order) and the Switch/Mixtral
//! auxiliary load-balancing loss.
//!
//! Math, for tokens `t < T`, experts `e < E`, router probabilities `p = softmax(x·W_rᵀ)`, the
//! top-k set `K_t` and `S_t = Σ_{e∈K_t} p_te`:
//! - `y_t = Σ_{e∈K_t, kept} w_te · expert_e(x_t) (+ shared(x_t))`, `w_te = p_te / S_t`;
//! - aux (HF `load_balancing_loss_func` for one layer): `L_aux = E · Σ_e f_e · P_e` with
//!   `f_e = #{t : e ∈ K_t} / T` (assignments before capacity drops, not differentiated) and
//!   `P_e = (1/T) Σ_t p_te`, so `∂L_aux/∂p_te = E · f_e / T`;
//! - renormalisation backward: `∂L/∂p_tm = (∂L/∂w_tm − Σ_{j∈K_t} w_tj ∂L/∂w_tj) / S_t` for
//!   `m ∈ K_t`; then the softmax backward to the router logits.

use std::sync::Arc;

use super::mlp::{MlpCache, SwiGlu};
use super::{linear_backward_input, linear_forward_new, Act, Pass, WeightGradStore, WeightTask};
use crate::error::Result;
use crate::layout::View;
use crate::profile::{time, Kernel};

/// A MoE feed-forward layer (views relative to the parameter slice).
#[derive(Debug, Clone)]
pub struct Moe {
    /// Router `[E, hidden]` (HF `mlp.gate.weight`).
    pub router: View,
    pub experts: Vec<SwiGlu>,
    pub shared: Option<SwiGlu>,
    pub top_k: usize,
    /// `None`: dropless. `Some(c)`: each expert takes at most `ceil(c·T·k/E)` assignments.
    pub capacity_factor: Option<f32>,
    /// Weight of this layer's auxiliary loss in the total loss (0 = off).
    pub aux_coef: f32,
    /// With the sequences split over ranks (context parallelism): the group the auxiliary
    /// loss's statistics `f_e`, `P_e` are summed over, so that they are the whole batch's.
    pub seq_group: Option<Arc<dyn super::SequenceGroup>>,
}

/// The routing decisions of one forward.
#[derive(Debug, Clone)]
pub struct Routing {
    /// Router probabilities `[T, E]`.
    pub probs: Vec<f32>,
    /// Chosen experts `[T, k]`, by decreasing probability (ties: lower index first).
    pub experts: Vec<usize>,
    /// Renormalised weights `[T, k]`.
    pub weights: Vec<f32>,
    /// Per expert, its kept assignments `(token, slot)` in token order.
    pub assigned: Vec<Vec<(usize, usize)>>,
    /// Per expert, assignments before capacity drops.
    pub counts: Vec<usize>,
}

impl Routing {
    /// Bytes of the routing tables.
    pub fn bytes(&self) -> usize {
        use std::mem::size_of;
        let pairs: usize = self.assigned.iter().map(Vec::len).sum();
        super::act_bytes(&self.probs)
            + super::act_bytes(&self.weights)
            + (self.experts.len() + self.counts.len()) * size_of::<usize>()
            + pairs * size_of::<(usize, usize)>()
    }

    /// Number of assignments dropped by the capacity limit.
    pub fn dropped(&self) -> usize {
        self.counts.iter().sum::<usize>() - self.assigned.iter().map(Vec::len).sum::<usize>()
    }
}

/// One expert's saved forward: gathered inputs, its MLP cache, its (unweighted) outputs.
#[derive(Debug, Clone)]
pub struct ExpertCache {
    pub x: Act,
    pub mlp: MlpCache,
    pub out: Act,
}

/// Everything MoE backward needs.
#[derive(Debug, Clone)]
pub struct MoeCache {
    pub routing: Routing,
    pub experts: Vec<Option<ExpertCache>>,
    pub shared: Option<MlpCache>,
    /// Unweighted auxiliary loss `L_aux` of this layer.
    pub aux: f32,
    /// `f_e` of every expert and the token count `T` it is over (the whole batch's when the
    /// sequences are split over a [`super::SequenceGroup`]): the auxiliary-loss gradient.
    pub aux_f: Vec<f32>,
    pub aux_tokens: usize,
}

impl MoeCache {
    /// Bytes of the saved activations and routing.
    pub fn bytes(&self) -> usize {
        let experts: usize = self
            .experts
            .iter()
            .flatten()
            .map(|e| super::act_bytes(&e.x) + e.mlp.bytes() + super::act_bytes(&e.out))
            .sum();
        self.routing.bytes() + experts + self.shared.as_ref().map_or(0, MlpCache::bytes)
    }
}

impl Moe {
    pub fn num_experts(&self) -> usize {
        self.router.shape[0]
    }

    /// Router probabilities, top-k, renormalised weights and capacity assignment.
    pub fn route(&self, p: &[f32], x: &[f32]) -> Result<Routing> {
        let e_n = self.num_experts();
        let hidden = self.router.shape[1];
        let t_n = x.len() / hidden;
        let k = self.top_k;
        let logits = linear_forward_new(p, &self.router, x)?;
        time(Kernel::Router, || -> Result<Routing> {
            let mut probs = vec![0.0; t_n * e_n];
            tensor::softmax::softmax_rows(&logits, e_n, &mut probs)?;
            let mut experts = vec![0usize; t_n * k];
            let mut weights = vec![0.0f32; t_n * k];
            let mut order: Vec<usize> = (0..e_n).collect();
            for t in 0..t_n {
                let pr = &probs[t * e_n..(t + 1) * e_n];
                order.iter_mut().enumerate().for_each(|(i, o)| *o = i);
                // Stable sort by decreasing probability: ties keep the lower expert index first.
                order.sort_by(|&a, &b| pr[b].total_cmp(&pr[a]));
                let sum: f32 = order[..k].iter().map(|&e| pr[e]).sum();
                for j in 0..k {
                    experts[t * k + j] = order[j];
                    weights[t * k + j] = pr[order[j]] / sum;
                }
            }
            let capacity = self
                .capacity_factor
                .map(|c| (c * (t_n * k) as f32 / e_n as f32).ceil() as usize);
            let mut assigned = vec![Vec::new(); e_n];
            let mut counts = vec![0usize; e_n];
            for t in 0..t_n {
                for j in 0..k {
                    let e = experts[t * k + j];
                    counts[e] += 1;
                    if capacity.is_none_or(|c| assigned[e].len() < c) {
                        assigned[e].push((t, j));
                    }
                }
            }
            Ok(Routing {
                probs,
                experts,
                weights,
                assigned,
                counts,
            })
        })
    }

    /// `x [T, hidden] -> y [T, hidden]`.
    pub fn forward(&self, p: &[f32], x: &[f32], pass: &Pass) -> Result<(Vec<f32>, MoeCache)> {
        let hidden = self.router.shape[1];
        let keep_product = pass.recompute != super::Recompute::Selective;
        let routing = self.route(p, x)?;
        let t_n = x.len() / hidden;
        let k = self.top_k;
        let mut y = vec![0.0; x.len()];
        let mut caches = Vec::with_capacity(self.experts.len());
        for (e, expert) in self.experts.iter().enumerate() {
            let list = &routing.assigned[e];
            if list.is_empty() {
                caches.push(None);
                continue;
            }
            let mut xs = vec![0.0; list.len() * hidden];
            time(Kernel::Router, || {
                for (i, &(t, _)) in list.iter().enumerate() {
                    xs[i * hidden..(i + 1) * hidden]
                        .copy_from_slice(&x[t * hidden..(t + 1) * hidden]);
                }
            });
            let (out, mlp) = expert.forward(p, &xs, keep_product)?;
            time(Kernel::Router, || {
                for (i, &(t, j)) in list.iter().enumerate() {
                    let w = routing.weights[t * k + j];
                    let yt = &mut y[t * hidden..(t + 1) * hidden];
                    for (a, b) in yt.iter_mut().zip(&out[i * hidden..(i + 1) * hidden]) {
                        *a += w * b;
                    }
                }
            });
            caches.push(Some(ExpertCache {
                x: Arc::new(xs),
                mlp,
                out: Arc::new(out),
            }));
        }
        let shared = match &self.shared {
            Some(s) => {
                let (ys, c) = s.forward(p, x, keep_product)?;
                y.iter_mut().zip(&ys).for_each(|(a, b)| *a += b);
                Some(c)
            }
            None => None,
        };
        let e_n = self.num_experts();
        // [assignments per expert, probability sum per expert, tokens], summed over the
        // sequence group when the sequences are split.
        let mut stats: Vec<f64> = routing.counts.iter().map(|&c| c as f64).collect();
        stats.extend((0..e_n).map(|e| {
            (0..t_n)
                .map(|t| routing.probs[t * e_n + e] as f64)
                .sum::<f64>()
        }));
        stats.push(t_n as f64);
        if let Some(g) = &self.seq_group {
            g.sum(&mut stats)?;
        }
        let tokens = stats[2 * e_n];
        let mut aux = 0.0f64;
        for e in 0..e_n {
            aux += (stats[e] / tokens) * (stats[e_n + e] / tokens);
        }
        let aux_f = (0..e_n).map(|e| (stats[e] / tokens) as f32).collect();
        let cache = MoeCache {
            routing,
            experts: caches,
            shared,
            aux: (aux * e_n as f64) as f32,
            aux_f,
            aux_tokens: tokens as usize,
        };
        Ok((y, cache))
    }

    /// Input gradient (written) from `dy`, including the router and auxiliary-loss paths;
    /// records every weight gradient. `x` is the forward input.
    pub fn backward_input(
        &self,
        p: &[f32],
        x: &Act,
        cache: MoeCache,
        dy: Act,
        pass: &Pass,
        store: &mut WeightGradStore,
    ) -> Result<Vec<f32>> {
        let hidden = self.router.shape[1];
        let e_n = self.num_experts();
        let t_n = x.len() / hidden;
        let k = self.top_k;
        let r = &cache.routing;
        let mut dx = vec![0.0; x.len()];
        let mut dw = vec![0.0f32; t_n * k];
        for (e, (expert, c)) in self.experts.iter().zip(cache.experts).enumerate() {
            let Some(c) = c else { continue };
            let list = &r.assigned[e];
            let mut dout = vec![0.0; list.len() * hidden];
            time(Kernel::Router, || {
                for (i, &(t, j)) in list.iter().enumerate() {
                    let w = r.weights[t * k + j];
                    let dyt = &dy[t * hidden..(t + 1) * hidden];
                    let o = &c.out[i * hidden..(i + 1) * hidden];
                    dw[t * k + j] = dyt.iter().zip(o).map(|(a, b)| a * b).sum();
                    for (d, g) in dout[i * hidden..(i + 1) * hidden].iter_mut().zip(dyt) {
                        *d = w * g;
                    }
                }
            });
            let dxs = expert.backward_input(p, &c.x, c.mlp, Arc::new(dout), store)?;
            time(Kernel::Router, || {
                for (i, &(t, _)) in list.iter().enumerate() {
                    for (a, b) in dx[t * hidden..(t + 1) * hidden]
                        .iter_mut()
                        .zip(&dxs[i * hidden..(i + 1) * hidden])
                    {
                        *a += b;
                    }
                }
            });
        }
        // d loss / d probs: renormalisation backward plus the auxiliary loss.
        let mut dp = vec![0.0f32; t_n * e_n];
        let aux_scale = pass.loss_scale * self.aux_coef;
        for t in 0..t_n {
            let sel = &r.experts[t * k..(t + 1) * k];
            let ws = &r.weights[t * k..(t + 1) * k];
            let dws = &dw[t * k..(t + 1) * k];
            let sum: f32 = sel.iter().map(|&e| r.probs[t * e_n + e]).sum();
            let dot: f32 = ws.iter().zip(dws).map(|(a, b)| a * b).sum();
            for j in 0..k {
                dp[t * e_n + sel[j]] = (dws[j] - dot) / sum;
            }
            if aux_scale != 0.0 {
                for e in 0..e_n {
                    let f = cache.aux_f[e];
                    dp[t * e_n + e] += aux_scale * e_n as f32 * f / cache.aux_tokens as f32;
                }
            }
        }
        let mut dlogits = vec![0.0; t_n * e_n];
        time(Kernel::Router, || {
            tensor::softmax::softmax_rows_backward(&dp, &r.probs, e_n, &mut dlogits)
        })?;
        linear_backward_input(p, &self.router, &dlogits, &mut dx, true)?;
        store.push(WeightTask::Linear {
            w: self.router.clone(),
            dy: Arc::new(dlogits),
            x: x.clone(),
        });
        if let (Some(s), Some(c)) = (&self.shared, cache.shared) {
            let dxs = s.backward_input(p, x, c, dy, store)?;
            dx.iter_mut().zip(&dxs).for_each(|(a, b)| *a += b);
        }
        Ok(dx)
    }
}
