//! Expert parallelism: the experts of every MoE layer are spread over the `ep` ranks of a
//! group carved out of dp × cp (the mesh's expert view `[pp, edp, ep, tp]`), E/ep per rank.
//! Each rank routes its own tokens; every assignment's token row travels to the rank holding
//! its expert (all-to-all-v of rows, after an all-to-all of the per-expert row counts), the
//! experts run over the rows of every rank, and the outputs travel back and are combined in
//! expert order — the MoE layer's [`model::layers::moe::Moe::forward`] with an
//! [`ExpertExchange`]; backward mirrors it. The rows are gathered, exchanged (over the host
//! transports, or NCCL with `XTRAIN_BACKEND=nccl`) and combined on the rank's device. The
//! shared expert runs while the tokens travel.
//!
//! Gradients: ranks with the same ep coordinate hold the same experts, so the executor
//! averages over the expert-data-parallel group (`dp·cp/ep` ranks) and shards ZeRO over it.
//! Before each reduction ([`crate::stage::StageModel::prepare_reduction`]) the decoder makes
//! the two kinds of tensors right: the replicated ones (attention, norms, router, shared
//! expert, embedding, head) are averaged over the ep group too — together, an average over
//! dp × cp — and the experts' are divided by ep, because each already sums the tokens of all
//! ep ranks: `(1/(dp·cp))·Σ_all = (1/ep)·mean_edp`.
use comm::ProcessGroup;
use model::layers::moe::{ExpertExchange, RowsInFlight};
use model::{ModelError, Result};
use tensor::buf::Buf;

use crate::nccl::{NcclGroup, NcclSlot};

/// The ep group as the MoE layers' [`ExpertExchange`]: the rows over the group's host
/// transports (downloaded from a GPU and uploaded at the other end), or over NCCL when one is
/// attached ([`EpExchange::attach_nccl`]) and the rows lie on a GPU. The row counts always
/// travel over the host (a few integers per expert, needed on the host to size the buffers).
#[derive(Debug, Clone)]
pub struct EpExchange {
    group: ProcessGroup,
    nccl: NcclSlot,
}

impl EpExchange {
    pub fn new(group: ProcessGroup) -> EpExchange {
        EpExchange {
            group,
            nccl: NcclSlot::default(),
        }
    }

    /// The ep group.
    pub fn group(&self) -> &ProcessGroup {
        &self.group
    }

    /// Sends the device rows over `nccl`, a communicator of the ep group (on the
    /// communication stream: the exchange overlaps the shared expert's kernels). Once.
    pub fn attach_nccl(&self, nccl: NcclGroup) -> std::result::Result<(), crate::ParallelError> {
        self.nccl.attach(nccl, self.group.size(), "ep")
    }
}

fn collective(e: impl std::fmt::Display) -> ModelError {
    ModelError::Collective(format!("expert all-to-all: {e}"))
}

impl ExpertExchange for EpExchange {
    fn size(&self) -> usize {
        self.group.size()
    }

    fn rank(&self) -> usize {
        self.group.rank()
    }

    fn exchange_counts(&self, send: &[Vec<usize>]) -> Result<Vec<Vec<usize>>> {
        let per = send.first().map_or(0, Vec::len);
        if send.len() != self.size() || send.iter().any(|c| c.len() != per) || per == 0 {
            return Err(collective(format!(
                "{} count lists for {} members (each of one non-zero length)",
                send.len(),
                self.size()
            )));
        }
        let flat: Vec<i64> = send.iter().flatten().map(|&c| c as i64).collect();
        let mut got = vec![0i64; flat.len()];
        self.group.all_to_all(&flat, &mut got).map_err(collective)?;
        Ok(got
            .chunks(per)
            .map(|c| c.iter().map(|&v| v.max(0) as usize).collect())
            .collect())
    }

    fn all_to_all_rows(
        &self,
        send: Buf,
        send_rows: &[usize],
        recv_rows: &[usize],
        width: usize,
    ) -> Result<RowsInFlight> {
        let send_counts: Vec<usize> = send_rows.iter().map(|r| r * width).collect();
        let recv_counts: Vec<usize> = recv_rows.iter().map(|r| r * width).collect();
        if let (Some(nccl), Buf::Cuda(d)) = (self.nccl.for_buf(&send), &send) {
            let mut recv = d
                .gpu()
                .alloc::<f32>(recv_counts.iter().sum())
                .map_err(tensor::TensorError::from)?;
            let flight = nccl
                .all_to_all_v(
                    d.as_slice(),
                    &send_counts,
                    recv.as_mut_slice(),
                    &recv_counts,
                )
                .map_err(collective)?;
            return Ok(Box::new(move || {
                flight.join().map_err(collective)?;
                drop(send); // after the compute stream waited for the exchange
                Ok(Buf::Cuda(recv))
            }));
        }
        // Over the host transports: the rows (from a GPU downloaded into page-locked
        // scratch) exchanged into a buffer of the length the counts give, uploaded from it.
        let dev = send.dev();
        let total = recv_counts.iter().sum();
        let work = self.group.all_to_all_v_into_async(
            send.into_host_buf()?,
            send_counts,
            dev.host_buf(total)?,
        );
        Ok(Box::new(move || {
            let (_, data, got) = work.wait().map_err(collective)?;
            if got != recv_counts {
                return Err(collective(format!(
                    "received {got:?} values per member where the counts said {recv_counts:?}"
                )));
            }
            Ok(dev.from_host(data)?)
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_and_rows_travel_on_one_rank_and_bad_counts_are_refused() {
        let comm = comm::Communicator::single_process().unwrap();
        let ex = EpExchange::new(comm.world().clone());
        assert_eq!(ex.exchange_counts(&[vec![3, 0, 2]]).unwrap(), [[3, 0, 2]]);
        for bad in [vec![], vec![vec![1], vec![2]], vec![vec![]]] {
            let e = ex.exchange_counts(&bad).unwrap_err().to_string();
            assert!(e.contains("count lists"), "{bad:?}: {e}");
        }
        let rows: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let wait = ex
            .all_to_all_rows(Buf::Host(rows.clone()), &[3], &[3], 4)
            .unwrap();
        assert_eq!(wait().unwrap().to_vec().unwrap(), rows);
        // Rows that disagree with the counts the receiver was told are an error, not a
        // silent misread.
        let wait = ex.all_to_all_rows(Buf::Host(rows), &[3], &[2], 4).unwrap();
        let e = wait().unwrap_err().to_string();
        assert!(
            e.contains("output has 8 elements for the 12 received"),
            "{e}"
        );
    }
}
