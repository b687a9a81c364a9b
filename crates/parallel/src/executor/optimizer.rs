//! The optimizer step of the executor: the global gradient norm (over the dp shards, the tp
//! group and the pipeline stages), fp16 overflow detection, torch's `clip_grad_norm_`, AdamW on
//! what this rank updates, and (ZeRO-1/2) the all-gather of the updated weights.
use std::ops::Range;

use comm::ProcessGroup;

use tensor::buf::{Buf, BufMut, BufRef};
use tensor::cuda::ops::{adamw, adamw_bits, AdamScalars};

use super::offload::adamw_from_bits;
use super::run::terr;
use super::Executor;
use crate::data_parallel::ZeroStage;
use crate::precision::{Bucketed, Flat, Half, CHUNK, DEVICE_CHUNK};
use crate::stage::StageModel;
use crate::ParallelError;

/// Sum of one f64 per rank of `group`, added in rank order (the same bits on every rank).
fn sum_over(group: &ProcessGroup, x: f64) -> Result<f64, ParallelError> {
    if group.size() == 1 {
        return Ok(x);
    }
    let mut all = vec![0i64; group.size()];
    group.all_gather(&[x.to_bits() as i64], &mut all)?;
    Ok(all.iter().map(|&b| f64::from_bits(b as u64)).sum())
}

impl<M: StageModel> Executor<M> {
    /// The flat range AdamW updates here, as indices of (grads, compute params, master/m/v).
    pub(super) fn own_ranges(&self) -> (Range<usize>, Range<usize>, Range<usize>) {
        let own = self.spec.range(self.dp.rank());
        let local = 0..own.len();
        let all = 0..self.spec.total();
        match self.cfg.zero {
            ZeroStage::Ddp => (all.clone(), all.clone(), all),
            ZeroStage::One => (own.clone(), own, local),
            ZeroStage::Two => (local.clone(), own, local),
            ZeroStage::Three => (local.clone(), local.clone(), local),
        }
    }

    /// Σ g² of the whole model's (loss-scaled) gradient: this rank's part, summed over the dp
    /// shards (ZeRO ≥ 1), the tp group (inside the model) and the pipeline stages.
    fn global_grad_sq(&self) -> Result<f64, ParallelError> {
        let zero = self.cfg.zero;
        let (gr, _, _) = self.own_ranges();
        // `flat` is what `gr` holds in model indices.
        let flat = if zero == ZeroStage::Ddp {
            0..self.spec.total()
        } else {
            self.spec.range(self.dp.rank())
        };
        let shift = flat.start - gr.start;
        let grads = &self.grads;
        // A device error inside the model's callback is kept and reported after it.
        let failed = std::sync::Mutex::new(None);
        let mut sq = self.model.grad_sq_sum(flat, &|r: Range<usize>| match grads
            .try_sq_sum(r.start - shift..r.end - shift)
        {
            Ok(s) => s,
            Err(e) => {
                *failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                f64::NAN
            }
        })?;
        if let Some(e) = failed.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(terr(e));
        }
        if zero.shards_optimizer() {
            sq = sum_over(&self.dp, sq)?;
        }
        if let Some(p) = &self.pipe {
            // Replicas hold equal gradients after their reduction: each layer counted once.
            // (Dividing by 1 or 2 is exact, so every rank keeps the same bits.)
            sq = sum_over(&p.group, sq)? / p.replicas as f64;
        }
        Ok(sq)
    }

    /// Clipping + AdamW on what this rank owns, then (stages 1/2) the parameter all-gather.
    /// Returns the global gradient norm and whether the step was applied (fp16: skipped when
    /// the gradients overflowed).
    pub(super) fn optimizer_step(&mut self) -> Result<(f32, bool), ParallelError> {
        let sq = self.global_grad_sq()?;
        let loss_scale = self.scaler.scale;
        // True gradient = stored / scale, so ‖g‖ = sqrt(Σ stored²) / scale.
        let norm = sq.sqrt() / loss_scale;
        // The delayed update that ran beside this step goes into the weights whatever this
        // step's fate.
        let stored = self.store_delayed_update()?;
        if !self.scaler.update(sq.is_finite()) {
            if stored {
                self.gather_updated()?;
            }
            return Ok((norm as f32, false));
        }
        // torch.nn.utils.clip_grad_norm_: g *= min(1, max_norm / (‖g‖ + 1e-6)); the loss scale
        // comes off in the same multiplication.
        let clip = match self.cfg.max_grad_norm {
            Some(c) => (c as f64 / (norm + 1e-6)).min(1.0),
            None => 1.0,
        };
        let factor = (clip / loss_scale) as f32;
        self.step += 1;
        if self.delays(self.step) {
            // Held: it runs beside the next step, whose gradients are taken at these weights.
            self.hold_update(factor)?;
            if stored {
                self.gather_updated()?;
            }
            return Ok((norm as f32, true));
        }
        // Weights written in place: after any upload of a delayed update still unordered.
        self.order_uploads(None)?;
        let (gr, pr, mr) = self.own_ranges();
        model::profile::time(model::profile::Kernel::Optimizer, || {
            if self.cfg.device.is_cuda() && !self.cfg.offload_optimizer {
                self.device_update(factor, (gr, pr, mr))
            } else {
                self.host_update(factor, (gr, pr, mr))
            }
        })?;
        self.gather_updated()?;
        Ok((norm as f32, true))
    }

    /// ZeRO-1/2: the all-gather of the weights each dp rank has updated its shard of.
    fn gather_updated(&mut self) -> Result<(), ParallelError> {
        if !(matches!(self.cfg.zero, ZeroStage::One | ZeroStage::Two) && self.dp.size() > 1) {
            return Ok(());
        }
        if let Some(nccl) = self.cfg.nccl.clone() {
            // In place in the full weight buffer, on the devices.
            return self.gather_updated_nccl(&nccl);
        }
        // All-gather the updated weights unit by unit (buffer bounded by one unit), in their
        // own precision, written back bit for bit.
        for u in 0..self.units.len() {
            let w = self.gather_async(u)?;
            let full = self.finish_gather_piece(u, w)?;
            self.params.write_piece(self.units[u].start, &full)?;
            self.gathered_bytes.sub(full.len() * full.elem_bytes());
        }
        Ok(())
    }

    /// AdamW on the host, bucket by bucket of the gradients (fp32) or chunk by chunk through
    /// the fp32 master (16-bit storage, ZeRO-Offload: the gradients downloaded from a GPU and
    /// the weights uploaded).
    fn host_update(
        &mut self,
        factor: f32,
        (gr, pr, mr): (Range<usize>, Range<usize>, Range<usize>),
    ) -> Result<(), ParallelError> {
        let opt = self.cfg.adamw;
        let (t, lr) = (self.step, self.lr);
        let (m, v) = (
            &mut self.m.as_host_mut("the optimizer").map_err(terr)?[mr.clone()],
            &mut self.v.as_host_mut("the optimizer").map_err(terr)?[mr.clone()],
        );
        let offload = self.cfg.offload_optimizer;
        match (&mut self.params, &mut self.grads) {
            (Flat::F32(p), grads) if grads.is_f32() && !offload => {
                // Bucket by bucket (AdamW is elementwise): the piece at flat offset `s` of the
                // gradients pairs with the same offset from the starts of `pr` and `mr`.
                grads.f32_pieces_mut(gr.clone(), |s, g| {
                    let o = s - gr.start;
                    let n = g.len();
                    opt.update_scaled(
                        t,
                        lr,
                        opt.weight_decay,
                        factor,
                        &mut p[pr.start + o..pr.start + o + n],
                        g,
                        &mut m[o..o + n],
                        &mut v[o..o + n],
                    );
                });
            }
            (params, grads) => {
                // 16-bit or offloaded: chunk by chunk, bring the gradients to the host as
                // fp32, clip and unscale, update the fp32 master, store it into the weights
                // (rounded; uploaded from the host under ZeRO-Offload).
                let master = &mut self
                    .master
                    .as_host_mut("the master weights")
                    .map_err(terr)?[mr.clone()];
                let n = master.len();
                let step = (t, lr, factor);
                // 16-bit gradients as bits on the host — under ZeRO-Offload landed during the
                // backward ([`super::offload`]), in DEVICE_CHUNK pieces; on the CPU without it
                // the buckets' own bits — each piece widened, updated and rounded into the
                // weights in one pass over the thread budget (on a GPU its weights go up from
                // a page-locked stage while the next piece is updated).
                if let Some(kind) = self.cfg.precision.half() {
                    let (pieces, mut uploads) = match &mut self.offload {
                        Some(traffic) => {
                            let (bits, uploads) = traffic.landed(grads)?;
                            let pieces: Vec<(usize, &[u16])> = (0..n)
                                .step_by(DEVICE_CHUNK)
                                .map(|s| (s, &bits[s..(s + DEVICE_CHUNK).min(n)]))
                                .collect();
                            (Some(pieces), uploads)
                        }
                        None if !offload => {
                            let pieces = grads
                                .half_pieces(gr.clone())
                                .map(|p| p.into_iter().map(|(s, g)| (s - gr.start, g)).collect());
                            (pieces, None)
                        }
                        None => (None, None),
                    };
                    if let Some(pieces) = pieces {
                        for (i, (o, g)) in pieces.into_iter().enumerate() {
                            let stage = uploads.as_deref_mut().map(|u| &mut u[i % 2]);
                            let e = o + g.len();
                            params.store_rounded(pr.start + o, g.len(), stage, |out| {
                                let state = (&mut master[o..e], &mut m[o..e], &mut v[o..e]);
                                adamw_from_bits(kind, &opt, step, g, state, out)
                            })?;
                        }
                        return Ok(());
                    }
                }
                // Offloaded from a GPU, chunks of DEVICE_CHUNK: each costs a copy, whose fixed
                // cost 64 Ki elements would not amortise.
                let chunk = if self.cfg.device.is_cuda() {
                    DEVICE_CHUNK
                } else {
                    CHUNK
                };
                let grads: &Bucketed = grads;
                pipelined_chunks(
                    n,
                    chunk,
                    [Vec::new(), Vec::new()],
                    |r, g| {
                        g.resize(r.len(), 0.0);
                        grads.read_into(gr.start + r.start..gr.start + r.end, g)
                    },
                    |r, g| {
                        let (s, e) = (r.start, r.end);
                        opt.update_scaled(
                            t,
                            lr,
                            opt.weight_decay,
                            factor,
                            &mut master[s..e],
                            g,
                            &mut m[s..e],
                            &mut v[s..e],
                        );
                        params.write(pr.start + s, &master[s..e])
                    },
                )
                .map_err(terr)?;
            }
        }
        Ok(())
    }

    /// AdamW on the GPU, piece by piece of the gradient buckets: each piece scaled by
    /// `factor` (clipping and unscaling), then AdamW's kernel on the matching ranges of the
    /// fp32 weights and the moments; in 16-bit training one kernel from the gradient bits
    /// through the fp32 master and moments into the 16-bit weights (`adamw_bits`): the same
    /// operations as the host path.
    fn device_update(
        &mut self,
        factor: f32,
        (gr, pr, mr): (Range<usize>, Range<usize>, Range<usize>),
    ) -> Result<(), ParallelError> {
        let opt = self.cfg.adamw;
        let s = AdamScalars::new(opt.beta1, opt.beta2, opt.eps, self.lr, self.step);
        let decay = 1.0 - self.lr * opt.weight_decay;
        let half = self.cfg.precision.half().is_some();
        let (params, master, m, v) = (&mut self.params, &mut self.master, &mut self.m, &mut self.v);
        let step = |o: usize, g: BufRef<'_>, p: BufMut<'_>, m: &mut Buf, v: &mut Buf| {
            let n = g.len();
            let (BufMut::Cuda(pd), BufRef::Cuda(gd), BufMut::Cuda(md), BufMut::Cuda(vd)) = (
                p,
                g,
                m.m().slice_mut(mr.start + o..mr.start + o + n),
                v.m().slice_mut(mr.start + o..mr.start + o + n),
            ) else {
                return Err(tensor::TensorError::Device(
                    "the optimizer's buffers are not all on the GPU".into(),
                ));
            };
            Ok(adamw(pd, gd, md, vd, &[(n, decay)], s)?)
        };
        if !half {
            let Flat::Dev(p) = params else {
                return Err(terr(tensor::TensorError::Device(
                    "fp32 weights not on the GPU".into(),
                )));
            };
            let mut result = Ok(());
            self.grads.f32_views_mut(gr.clone(), |at, mut g| {
                if result.is_ok() {
                    let o = at - gr.start;
                    let n = g.len();
                    result = tensor::ops::scale(g.reborrow(), factor).and_then(|()| {
                        step(
                            o,
                            g.as_ref(),
                            p.m().slice_mut(pr.start + o..pr.start + o + n),
                            m,
                            v,
                        )
                    });
                }
            });
            return result.map_err(terr);
        }
        // 16-bit: one pass per gradient piece, from its bits to the master, the moments and
        // the 16-bit weights (widen, scale, AdamW and round in one kernel).
        let on_gpu = |what: &str| {
            terr(tensor::TensorError::Device(format!(
                "16-bit {what} not on the GPU"
            )))
        };
        let Flat::DevHalf { kind, bits: w } = params else {
            return Err(on_gpu("weights"));
        };
        let pieces = self
            .grads
            .dev_half_pieces(gr.clone())
            .ok_or_else(|| on_gpu("gradients"))?;
        for (at, g) in pieces {
            let o = at - gr.start;
            let n = g.len();
            let mrange = mr.start + o..mr.start + o + n;
            let (BufMut::Cuda(pd), BufMut::Cuda(md), BufMut::Cuda(vd)) = (
                master.m().slice_mut(mrange.clone()),
                m.m().slice_mut(mrange.clone()),
                v.m().slice_mut(mrange),
            ) else {
                return Err(on_gpu("master weights or moments"));
            };
            let wd = w.slice_mut(pr.start + o..pr.start + o + n);
            let f16 = *kind == Half::F16;
            adamw_bits(pd, g, md, vd, wd, f16, factor, decay, s).map_err(|e| terr(e.into()))?;
        }
        Ok(())
    }
}

/// Runs `update` over the chunks `0..n` (`chunk` elements each, the last shorter) of a
/// buffer whose values `read` fetches, with the read of the next chunk overlapping the update
/// of this one: `read` runs on a second thread, a chunk ahead, into one of the two buffers
/// `bufs` handed back and forth (host vectors `read` sizes). An fp32 ZeRO-Offload step from
/// a GPU: the copy engine downloads chunk i + 1 while the cores run AdamW on chunk i and
/// chunk i's weights go back up. The chunks
/// are updated in order, each exactly as without the overlap; the first error of either
/// side ends the loop (the reader stops when the updater has gone).
fn pipelined_chunks<B: Send, E: Send>(
    n: usize,
    chunk: usize,
    bufs: [B; 2],
    read: impl Fn(Range<usize>, &mut B) -> Result<(), E> + Sync,
    mut update: impl FnMut(Range<usize>, &mut B) -> Result<(), E>,
) -> Result<(), E> {
    use std::sync::mpsc::sync_channel;
    if n == 0 {
        return Ok(());
    }
    let chunk = chunk.max(1);
    let ranges = move || (0..n).step_by(chunk).map(move |s| s..(s + chunk).min(n));
    std::thread::scope(|scope| {
        let (full_tx, full_rx) = sync_channel::<(Range<usize>, B, Result<(), E>)>(1);
        let (empty_tx, empty_rx) = sync_channel::<B>(2);
        // Both buffers are in the channel before the reader starts (it may be done, and its
        // end gone, before this side would send them).
        for b in bufs {
            // Cannot fail: the receiving end is here and the channel has room for both.
            let _ = empty_tx.send(b);
        }
        let read = &read;
        scope.spawn(move || {
            for r in ranges() {
                let Ok(mut g) = empty_rx.recv() else { return };
                let result = read(r.clone(), &mut g);
                if full_tx.send((r, g, result)).is_err() {
                    return;
                }
            }
        });
        for _ in ranges() {
            let Ok((r, mut g, result)) = full_rx.recv() else {
                break; // the reader panicked: the scope's end passes the panic on
            };
            result?;
            update(r, &mut g)?;
            // The reader may have finished already: then nobody needs the buffer.
            let _ = empty_tx.send(g);
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pipelined_chunks_update_every_chunk_in_order_and_stop_at_an_error() {
        let src: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        // Each buffer carries its own tag, to see both used.
        let bufs = || [(Vec::new(), 0u8), (Vec::new(), 1u8)];
        let read = |r: Range<usize>, (g, _): &mut (Vec<f32>, u8)| -> Result<(), String> {
            if r.start == 900 && r.len() == 1 {
                return Err("a read error".into()); // only with the chunk size 1 below
            }
            g.clear();
            g.extend_from_slice(&src[r]);
            Ok(())
        };
        for chunk in [7, 100, 1000, 4096] {
            let mut out = vec![0.0f32; src.len()];
            let (mut seen, mut tags) = (Vec::new(), Vec::new());
            pipelined_chunks(src.len(), chunk, bufs(), read, |r, (g, tag)| {
                seen.push(r.clone());
                tags.push(*tag);
                out[r]
                    .iter_mut()
                    .zip(g.iter())
                    .for_each(|(o, v)| *o = 2.0 * v);
                Ok(())
            })
            .unwrap();
            let want: Vec<f32> = src.iter().map(|v| 2.0 * v).collect();
            assert_eq!(out, want, "chunk {chunk}");
            let starts: Vec<usize> = seen.iter().map(|r| r.start).collect();
            assert_eq!(
                starts,
                (0..src.len()).step_by(chunk).collect::<Vec<_>>(),
                "chunk {chunk}"
            );
            // The two buffers alternate (the reader takes them back in the order returned).
            let alternate: Vec<u8> = (0..tags.len()).map(|i| (i % 2) as u8).collect();
            assert_eq!(tags, alternate, "chunk {chunk}");
        }
        // An error of the reader or of the update ends the loop (no hang: the reader stops
        // once the updater has gone).
        let e = pipelined_chunks(src.len(), 1, bufs(), read, |_, _| Ok(())).unwrap_err();
        assert_eq!(e, "a read error");
        let mut updates = 0;
        let e = pipelined_chunks(src.len(), 10, bufs(), read, |r, _| {
            updates += 1;
            if r.start == 50 {
                Err(format!("update of {r:?}"))
            } else {
                Ok(())
            }
        })
        .unwrap_err();
        assert_eq!((e.as_str(), updates), ("update of 50..60", 6));
        pipelined_chunks(0, 10, bufs(), read, |_, _| -> Result<(), String> {
            panic!("no chunk")
        })
        .unwrap();
    }
}
