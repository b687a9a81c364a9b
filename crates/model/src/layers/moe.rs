//! Mixtral-style mixture of experts: a softmax router over all experts, top-k selection with the
//! k weights renormalised to sum to one, SwiGLU experts, an optional shared expert, optional
//! capacity (assignments beyond capacity are dropped: the last in token order, or the least
//! probable) and the Switch/Mixtral auxiliary load-balancing loss.
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
use super::{
    linear_backward_input, linear_forward_new, Act, Buf, BufMut, BufRef, Kept, Pass,
    WeightGradStore, WeightTask,
};
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
    /// Over capacity, keep the most probable assignments (else the first in token order).
    pub drop_by_probability: bool,
    /// Auxiliary-loss-free balancing: a bias per expert added to the probabilities when the
    /// top-k are chosen (the weights stay the probabilities'), updated between steps by the
    /// trainer from the experts' loads (shared by every copy of the layer).
    pub bias: Option<Arc<std::sync::RwLock<Vec<f32>>>>,
    /// Weight of this layer's auxiliary loss in the total loss (0 = off).
    pub aux_coef: f32,
    /// With the sequences split over ranks (context parallelism): the group the auxiliary
    /// loss's statistics `f_e`, `P_e` are summed over, so that they are the whole batch's.
    pub seq_group: Option<Arc<dyn super::SequenceGroup>>,
    /// The global index of `experts[0]` (expert parallelism: this rank holds
    /// `first_expert..first_expert + experts.len()`).
    pub first_expert: usize,
    /// Expert parallelism: the ranks holding the other experts, which tokens are sent to.
    pub exchange: Option<Arc<dyn ExpertExchange>>,
}

/// Auxiliary-loss-free balancing (DeepSeek-V3, Wang et al. 2024): moves each expert's routing
/// bias by `rate` towards the mean load — up for the under-loaded, down for the over-loaded:
/// `b_e += rate·sign(mean − load_e)`. `loads` are the tokens each expert was chosen for.
pub fn balance_bias(bias: &mut [f32], loads: &[u64], rate: f32) {
    if loads.iter().all(|&x| x == 0) {
        return;
    }
    let mean = loads.iter().sum::<u64>() as f64 / loads.len() as f64;
    for (b, &n) in bias.iter_mut().zip(loads) {
        let d = mean - n as f64;
        *b += rate
            * if d > 0.0 {
                1.0
            } else if d < 0.0 {
                -1.0
            } else {
                0.0
            };
    }
}

/// The ranks the experts are spread over (expert parallelism): member `r` of `size()` holds
/// experts `r·E/size ..(r+1)·E/size`, and tokens travel to the members holding their experts
/// and back.
pub trait ExpertExchange: Send + Sync + std::fmt::Debug {
    fn size(&self) -> usize;
    fn rank(&self) -> usize;
    /// Row counts, one list per member (`send[d]` goes to member d, every list of one
    /// length); waits, and returns the list each member sent this one, in member order.
    fn exchange_counts(&self, send: &[Vec<usize>]) -> Result<Vec<Vec<usize>>>;
    /// Starts an all-to-all of rows of `width` values on the device of `send`, which holds
    /// `send_rows[d]` rows for each member d, member after member; the returned function
    /// waits for it and gives the rows each member sent this one (`recv_rows[m]` from member
    /// m, which the counts exchanged first told), member after member, on the same device.
    fn all_to_all_rows(
        &self,
        send: Buf,
        send_rows: &[usize],
        recv_rows: &[usize],
        width: usize,
    ) -> Result<RowsInFlight>;
}

/// An all-to-all of rows in flight ([`ExpertExchange::all_to_all_rows`]): call it to wait.
pub type RowsInFlight = Box<dyn FnOnce() -> Result<Buf> + Send>;

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
        use std::mem::{size_of, size_of_val};
        let pairs: usize = self.assigned.iter().map(Vec::len).sum();
        size_of_val(self.probs.as_slice())
            + size_of_val(self.weights.as_slice())
            + (self.experts.len() + self.counts.len()) * size_of::<usize>()
            + pairs * size_of::<(usize, usize)>()
    }

    /// Expert `e`'s kept assignments as row indices: their tokens and routing weights.
    pub fn rows_of(&self, e: usize, k: usize) -> (Vec<u32>, Vec<f32>) {
        self.assigned[e]
            .iter()
            .map(|&(t, j)| (t as u32, self.weights[t * k + j]))
            .unzip()
    }

    /// Number of assignments dropped by the capacity limit.
    pub fn dropped(&self) -> usize {
        self.counts.iter().sum::<usize>() - self.assigned.iter().map(Vec::len).sum::<usize>()
    }
}

/// One expert's saved forward: gathered inputs (read again only by its weight gradients, so
/// kept prepared for those products), its MLP cache, its (unweighted) outputs.
#[derive(Debug, Clone)]
pub struct ExpertCache {
    pub x: Kept,
    pub mlp: MlpCache,
    pub out: Act,
}

/// Expert parallelism's side of a forward: how many rows of each held expert came from each
/// member (`[member][local expert]`), and the outputs of this rank's own assignments as they
/// came back (rows in the order they were sent, [`SendPlan`]).
#[derive(Debug, Clone)]
pub struct Dispatch {
    pub received: Vec<Vec<usize>>,
    pub returned: Act,
}

/// Where this rank's assignments travel under expert parallelism: their token rows in
/// (member, expert, token) order — every member's block is its experts' rows in expert order
/// — with their routing weights, and per global expert its range of those rows. The same
/// order on the way out, on the way back and in the backward.
struct SendPlan {
    tokens: Vec<u32>,
    weights: Vec<f32>,
    /// `(token, slot)` of each row (the slot of the expert among the token's k).
    slots: Vec<(usize, usize)>,
    expert_rows: Vec<std::ops::Range<usize>>,
    /// Rows per member, and per member its experts' row counts (the counts it is told).
    member_rows: Vec<usize>,
    counts: Vec<Vec<usize>>,
}

impl SendPlan {
    fn new(r: &Routing, k: usize, members: usize, per: usize) -> SendPlan {
        let mut plan = SendPlan {
            tokens: Vec::new(),
            weights: Vec::new(),
            slots: Vec::new(),
            expert_rows: Vec::with_capacity(members * per),
            member_rows: Vec::with_capacity(members),
            counts: Vec::with_capacity(members),
        };
        for d in 0..members {
            let lists = &r.assigned[d * per..(d + 1) * per];
            for list in lists {
                let start = plan.tokens.len();
                for &(t, j) in list {
                    plan.tokens.push(t as u32);
                    plan.weights.push(r.weights[t * k + j]);
                    plan.slots.push((t, j));
                }
                plan.expert_rows.push(start..plan.tokens.len());
            }
            plan.counts.push(lists.iter().map(Vec::len).collect());
            plan.member_rows.push(lists.iter().map(Vec::len).sum());
        }
        plan
    }

    /// Adds `rows` (laid out as sent: what came back) into their tokens' rows of `y`, expert
    /// by expert — so each token sums its experts in index order, as without expert
    /// parallelism — scaled by the routing weights where `weighted`.
    fn combine(
        &self,
        rows: BufRef<'_>,
        weighted: bool,
        mut y: BufMut<'_>,
        hidden: usize,
    ) -> Result<()> {
        for r in self.expert_rows.iter().filter(|r| !r.is_empty()) {
            tensor::ops::scatter_add_rows(
                rows.slice(r.start * hidden..r.end * hidden),
                &self.tokens[r.clone()],
                weighted.then(|| &self.weights[r.clone()]),
                y.reborrow(),
                hidden,
            )?;
        }
        Ok(())
    }
}

/// The rows of held expert `l` in a buffer laid out member after member, each member's block
/// its `received[m]` experts' rows in expert order (what the all-to-all delivers): their row
/// indices, member by member — the expert's input rows in order, and where its outputs go back.
fn rows_of_held(received: &[Vec<usize>], l: usize) -> Vec<u32> {
    let mut idx = Vec::new();
    let mut at = 0usize;
    for counts in received {
        let start = at + counts[..l].iter().sum::<usize>();
        idx.extend((start..start + counts[l]).map(|i| i as u32));
        at += counts.iter().sum::<usize>();
    }
    idx
}

/// Everything MoE backward needs.
#[derive(Debug, Clone)]
pub struct MoeCache {
    pub routing: Routing,
    /// Per held expert: its inputs (all ranks' rows under expert parallelism), MLP cache and
    /// outputs.
    pub experts: Vec<Option<ExpertCache>>,
    /// Expert parallelism: the exchange's bookkeeping.
    pub dispatch: Option<Dispatch>,
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
            .map(|e| e.x.bytes() + e.mlp.bytes() + super::act_bytes(&e.out))
            .sum();
        let returned: usize = self.dispatch.iter().map(|d| d.returned.bytes()).sum();
        self.routing.bytes() + experts + returned + self.shared.as_ref().map_or(0, MlpCache::bytes)
    }
}

impl Moe {
    pub fn num_experts(&self) -> usize {
        self.router.shape[0]
    }

    /// Router probabilities, top-k, renormalised weights and capacity assignment. The router
    /// product runs on the buffers' device; its logits (T·E values) come to the host, where
    /// the decisions are made, so a GPU routes exactly as the CPU would on the same logits.
    pub fn route<'a1, 'a2>(
        &self,
        p: impl Into<BufRef<'a1>>,
        x: impl Into<BufRef<'a2>>,
    ) -> Result<Routing> {
        let (p, x): (BufRef<'_>, BufRef<'_>) = (p.into(), x.into());
        let e_n = self.num_experts();
        let hidden = self.router.shape[1];
        let t_n = x.len() / hidden;
        let k = self.top_k;
        let logits = linear_forward_new(p, &self.router, x)?.into_vec()?;
        time(Kernel::Router, || -> Result<Routing> {
            let mut probs = vec![0.0; t_n * e_n];
            tensor::softmax::softmax_rows(&logits, e_n, &mut probs)?;
            let mut experts = vec![0usize; t_n * k];
            let mut weights = vec![0.0f32; t_n * k];
            let mut order: Vec<usize> = (0..e_n).collect();
            let bias = self
                .bias
                .as_ref()
                .map(|b| b.read().unwrap_or_else(|e| e.into_inner()).clone());
            let mut score = vec![0.0f32; e_n];
            for t in 0..t_n {
                let pr = &probs[t * e_n..(t + 1) * e_n];
                order.iter_mut().enumerate().for_each(|(i, o)| *o = i);
                // The choice is by probability (plus the balancing bias when kept); stable
                // sort by decreasing score: ties keep the lower expert index first.
                match &bias {
                    Some(b) => score
                        .iter_mut()
                        .zip(pr.iter().zip(b))
                        .for_each(|(s, (p, b))| *s = p + b),
                    None => score.copy_from_slice(pr),
                }
                order.sort_by(|&a, &b| score[b].total_cmp(&score[a]));
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
                    if self.drop_by_probability || capacity.is_none_or(|c| assigned[e].len() < c) {
                        assigned[e].push((t, j));
                    }
                }
            }
            if let (Some(c), true) = (capacity, self.drop_by_probability) {
                // Keep each expert's `c` most probable assignments (ties: the earlier token),
                // then back in token order.
                for (e, list) in assigned.iter_mut().enumerate() {
                    if list.len() > c {
                        list.sort_by(|a, b| probs[b.0 * e_n + e].total_cmp(&probs[a.0 * e_n + e]));
                        list.truncate(c);
                        list.sort_unstable();
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

    /// `x [T, hidden] -> y [T, hidden]`, on the device of `x` (expert parallelism too: the rows
    /// are gathered, exchanged and combined there).
    pub fn forward<'a1, 'a2>(
        &self,
        p: impl Into<BufRef<'a1>>,
        x: impl Into<BufRef<'a2>>,
        pass: &Pass,
    ) -> Result<(Buf, MoeCache)> {
        let (p, x): (BufRef<'_>, BufRef<'_>) = (p.into(), x.into());
        let hidden = self.router.shape[1];
        let keep_product = pass.recompute != super::Recompute::Selective;
        let routing = self.route(p, x)?;
        let t_n = x.len() / hidden;
        let (y, caches, dispatch, shared) = match &self.exchange {
            Some(ex) => {
                let mut y = tensor::ops::zeros_like(x, x.len())?;
                let (c, d, s) = self.forward_parallel(p, x, &routing, keep_product, ex, y.m())?;
                (y, c, Some(d), s)
            }
            None => {
                let mut y = tensor::ops::zeros_like(x, x.len())?;
                let caches = self.forward_local(p, x, &routing, keep_product, y.m())?;
                let shared = match &self.shared {
                    Some(s) => {
                        let (ys, c) = s.forward(p, x, keep_product)?;
                        tensor::ops::add_assign(y.m(), ys.r())?;
                        Some(c)
                    }
                    None => None,
                };
                (y, caches, None, shared)
            }
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
            dispatch,
            shared,
            aux: (aux * e_n as f64) as f32,
            aux_f,
            aux_tokens: tokens as usize,
        };
        Ok((y, cache))
    }

    /// The routed experts on this rank's own tokens (every expert held): adds their weighted
    /// outputs into `y`, expert by expert (so each token sums its experts in index order).
    fn forward_local(
        &self,
        p: BufRef<'_>,
        x: BufRef<'_>,
        routing: &Routing,
        keep_product: bool,
        mut y: BufMut<'_>,
    ) -> Result<Vec<Option<ExpertCache>>> {
        let hidden = self.router.shape[1];
        let mut caches = Vec::with_capacity(self.experts.len());
        for (e, expert) in self.experts.iter().enumerate() {
            let (tokens, weights) = routing.rows_of(e, self.top_k);
            if tokens.is_empty() {
                caches.push(None);
                continue;
            }
            let xs = time(Kernel::Router, || {
                tensor::ops::gather_rows(x, &tokens, None, hidden)
            })?;
            let xs = Kept::new(Arc::new(xs))?;
            let (out, mlp) = expert.forward(p, xs.r(), keep_product)?;
            time(Kernel::Router, || {
                tensor::ops::scatter_add_rows(
                    out.r(),
                    &tokens,
                    Some(&weights),
                    y.reborrow(),
                    hidden,
                )
            })?;
            caches.push(Some(ExpertCache {
                x: xs,
                mlp,
                out: Arc::new(out),
            }));
        }
        Ok(caches)
    }

    /// The routed experts under expert parallelism: each assignment's token row goes to the
    /// member holding its expert (the members first learn how many rows of each of their
    /// experts come), the members run their experts over the rows of every member, the
    /// outputs come back in the order sent, and are added into `y` expert by expert (as
    /// [`Self::forward_local`] does); the shared expert runs while the tokens travel and is
    /// added after the routed experts. Rows are gathered, exchanged and combined on the device
    /// of `x`; only the counts and the routing live on the host.
    #[allow(clippy::type_complexity)]
    fn forward_parallel(
        &self,
        p: BufRef<'_>,
        x: BufRef<'_>,
        r: &Routing,
        keep_product: bool,
        ex: &Arc<dyn ExpertExchange>,
        mut y: BufMut<'_>,
    ) -> Result<(Vec<Option<ExpertCache>>, Dispatch, Option<MlpCache>)> {
        let hidden = self.router.shape[1];
        let plan = SendPlan::new(r, self.top_k, ex.size(), self.experts.len());
        let received = time(Kernel::ExpertExchange, || ex.exchange_counts(&plan.counts))?;
        let recv_rows: Vec<usize> = received.iter().map(|c| c.iter().sum()).collect();
        let send = time(Kernel::Router, || {
            tensor::ops::gather_rows(x, &plan.tokens, None, hidden)
        })?;
        let wait = ex.all_to_all_rows(send, &plan.member_rows, &recv_rows, hidden)?;
        // The shared expert overlaps the transfer; its output is added last.
        let shared = match &self.shared {
            Some(s) => Some(s.forward(p, x, keep_product)?),
            None => None,
        };
        let recv = time(Kernel::ExpertExchange, wait)?;
        // The reply has the layout of what came: each output row goes where its input was.
        let mut back = tensor::ops::zeros_like(x, recv.len())?;
        let mut caches = Vec::with_capacity(self.experts.len());
        for (l, expert) in self.experts.iter().enumerate() {
            let idx = rows_of_held(&received, l);
            if idx.is_empty() {
                caches.push(None);
                continue;
            }
            let xs = time(Kernel::Router, || {
                tensor::ops::gather_rows(recv.r(), &idx, None, hidden)
            })?;
            let xs = Kept::new(Arc::new(xs))?;
            let (out, mlp) = expert.forward(p, xs.r(), keep_product)?;
            time(Kernel::Router, || {
                tensor::ops::scatter_add_rows(out.r(), &idx, None, back.m(), hidden)
            })?;
            caches.push(Some(ExpertCache {
                x: xs,
                mlp,
                out: Arc::new(out),
            }));
        }
        let wait = ex.all_to_all_rows(back, &recv_rows, &plan.member_rows, hidden)?;
        let returned = time(Kernel::ExpertExchange, wait)?;
        time(Kernel::Router, || {
            plan.combine(returned.r(), true, y.reborrow(), hidden)
        })?;
        let shared = match shared {
            Some((ys, c)) => {
                tensor::ops::add_assign(y, ys.r())?;
                Some(c)
            }
            None => None,
        };
        let dispatch = Dispatch {
            received,
            returned: Arc::new(returned),
        };
        Ok((caches, dispatch, shared))
    }

    /// The routed experts' backward under expert parallelism, mirroring
    /// [`Self::forward_parallel`]: each assignment's weight gradient `dw` from the output that
    /// came back, its output gradient `w·dy` sent to the expert's member, the members' input
    /// gradients sent back and added into `dx` expert by expert. The shared expert's backward
    /// (given) runs while the gradients travel; its input gradient is returned.
    #[allow(clippy::too_many_arguments)]
    fn backward_parallel(
        &self,
        p: BufRef<'_>,
        r: &Routing,
        caches: Vec<Option<ExpertCache>>,
        d: Dispatch,
        dy: &Act,
        ex: &Arc<dyn ExpertExchange>,
        shared: (Option<(&SwiGlu, MlpCache)>, &Kept),
        dx: BufMut<'_>,
        dw: &mut [f32],
        store: &mut WeightGradStore,
    ) -> Result<Option<Buf>> {
        let hidden = self.router.shape[1];
        let k = self.top_k;
        let plan = SendPlan::new(r, k, ex.size(), self.experts.len());
        let recv_rows: Vec<usize> = d.received.iter().map(|c| c.iter().sum()).collect();
        // dL/dw_te = dy_t · expert_e(x_t) (as it came back); the expert's output gradient
        // w_te·dy_t.
        let dots = time(Kernel::Router, || {
            tensor::ops::row_dots(dy.r(), &plan.tokens, d.returned.r(), hidden)
        })?;
        for (&(t, j), v) in plan.slots.iter().zip(dots) {
            dw[t * k + j] = v;
        }
        let send = time(Kernel::Router, || {
            tensor::ops::gather_rows(dy.r(), &plan.tokens, Some(&plan.weights), hidden)
        })?;
        let wait = ex.all_to_all_rows(send, &plan.member_rows, &recv_rows, hidden)?;
        let (shared, x) = shared;
        let shared_dx = match shared {
            Some((s, c)) => Some(s.backward_input(p, x, c, dy.clone(), store)?),
            None => None,
        };
        let recv = time(Kernel::ExpertExchange, wait)?;
        let mut back = tensor::ops::zeros_like(dy.r(), recv.len())?;
        for (l, (expert, c)) in self.experts.iter().zip(caches).enumerate() {
            let Some(c) = c else { continue };
            let idx = rows_of_held(&d.received, l);
            let dout = time(Kernel::Router, || {
                tensor::ops::gather_rows(recv.r(), &idx, None, hidden)
            })?;
            let dxs = expert.backward_input(p, &c.x, c.mlp, Arc::new(dout), store)?;
            time(Kernel::Router, || {
                tensor::ops::scatter_add_rows(dxs.r(), &idx, None, back.m(), hidden)
            })?;
        }
        let wait = ex.all_to_all_rows(back, &recv_rows, &plan.member_rows, hidden)?;
        let grads = time(Kernel::ExpertExchange, wait)?;
        time(Kernel::Router, || {
            plan.combine(grads.r(), false, dx, hidden)
        })?;
        Ok(shared_dx)
    }

    /// Input gradient (written) from `dy`, including the router and auxiliary-loss paths;
    /// records every weight gradient. `x` is the forward input.
    pub fn backward_input<'a1>(
        &self,
        p: impl Into<BufRef<'a1>>,
        x: &Act,
        cache: MoeCache,
        dy: Act,
        pass: &Pass,
        store: &mut WeightGradStore,
    ) -> Result<Buf> {
        let p: BufRef<'_> = p.into();
        let hidden = self.router.shape[1];
        let e_n = self.num_experts();
        let t_n = x.len() / hidden;
        let k = self.top_k;
        let r = &cache.routing;
        let mut dx = tensor::ops::zeros_like(x.r(), x.len())?;
        let mut dw = vec![0.0f32; t_n * k];
        // The input as the router's and the shared expert's weight gradients read it.
        let xk = Kept::new(x.clone())?;
        // Under expert parallelism the shared expert's input gradient is computed while the
        // routed gradients travel, and added last, as without it.
        let mut shared_dx = None;
        let mut shared_cache = cache.shared;
        match (&self.exchange, cache.dispatch) {
            (Some(ex), Some(d)) => {
                let shared = match (&self.shared, shared_cache.take()) {
                    (Some(s), Some(c)) => Some((s, c)),
                    _ => None,
                };
                shared_dx = self.backward_parallel(
                    p,
                    r,
                    cache.experts,
                    d,
                    &dy,
                    ex,
                    (shared, &xk),
                    dx.m(),
                    &mut dw,
                    store,
                )?;
            }
            (None, None) => {
                for (e, (expert, c)) in self.experts.iter().zip(cache.experts).enumerate() {
                    let Some(c) = c else { continue };
                    let (tokens, weights) = r.rows_of(e, k);
                    // dL/dw_te = dy_t · expert_e(x_t); the expert's output gradient w_te·dy_t.
                    let dots = time(Kernel::Router, || {
                        tensor::ops::row_dots(dy.r(), &tokens, c.out.r(), hidden)
                    })?;
                    for (&(t, j), v) in r.assigned[e].iter().zip(dots) {
                        dw[t * k + j] = v;
                    }
                    let dout = time(Kernel::Router, || {
                        tensor::ops::gather_rows(dy.r(), &tokens, Some(&weights), hidden)
                    })?;
                    let dxs = expert.backward_input(p, &c.x, c.mlp, Arc::new(dout), store)?;
                    time(Kernel::Router, || {
                        tensor::ops::scatter_add_rows(dxs.r(), &tokens, None, dx.m(), hidden)
                    })?;
                }
            }
            _ => {
                return Err(crate::ModelError::InvalidBatch(
                    "a MoE cache from the other expert-parallel mode".into(),
                ))
            }
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
        let dlogits = Kept::new(Arc::new(x.dev().from_vec(dlogits)?))?;
        linear_backward_input(p, &self.router, dlogits.r(), dx.m(), true)?;
        store.push(WeightTask::Linear {
            w: self.router.clone(),
            dy: dlogits,
            x: xk.clone(),
        });
        let shared_dx = match shared_dx {
            Some(d) => Some(d),
            None => match (&self.shared, shared_cache) {
                (Some(s), Some(c)) => Some(s.backward_input(p, &xk, c, dy, store)?),
                _ => None,
            },
        };
        if let Some(dxs) = shared_dx {
            tensor::ops::add_assign(dx.m(), dxs.r())?;
        }
        Ok(dx)
    }
}
