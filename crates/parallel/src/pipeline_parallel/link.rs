//! A pipeline link: the channel of one stage boundary in one direction — activations from
//! stage `s` to `s + 1`, or their gradients from `s + 1` back to `s` — between the two ranks
//! that run those stages (the sender is rank 0 of the link, the receiver rank 1).
//!
//! A message is the flat `f32` buffer of [`crate::stage::StageModel::act_to_wire`], on the
//! rank's device. It travels over the host transports (a process group of the two ranks with
//! its own worker thread; a device buffer is downloaded into page-locked scratch, sent from
//! there, received into page-locked scratch at the other end and uploaded from it), or,
//! with `XTRAIN_BACKEND=nccl` and the buffer on a GPU, over an NCCL communicator of the same
//! two ranks queued on a side stream of the GPU ([`Link::use_nccl`]): the send waits on the
//! device for the kernels that made the message, the receiver's kernels wait on the device for
//! its arrival, and the host waits for neither. Either way each link delivers in the order its
//! messages were sent, and no link's message waits behind another link's.
//!
//! NCCL matches a link's messages by their order alone (the host transports also match tags),
//! so both ends must send and receive a link's micro-batches in one order: the validator
//! requires each stage's forwards and backwards in micro-batch order, and [`check_order`]
//! checks a rank's list again before NCCL links run it (a wrong order would hand one
//! micro-batch's activations to another silently).
use std::collections::HashMap;
use std::sync::Arc;

use comm::{ProcessGroup, Work};
use tensor::buf::{Buf, Dev, HostBuf};
use tensor::cuda::Gpu;

use super::Action;
use crate::nccl::{InFlight, NcclGroup};
use crate::ParallelError;

/// One stage boundary's channel in one direction (see the module doc).
#[derive(Clone, Debug)]
pub struct Link {
    host: ProcessGroup,
    nccl: Option<NcclGroup>,
}

/// A message on its way out; waiting for it releases its buffer.
#[must_use = "a message in flight is waited for before the step ends"]
pub enum Outgoing {
    Host(Work<HostBuf>),
    /// The send and the device buffer it reads (alive until the compute stream waited).
    Nccl(InFlight, Buf),
}

/// A posted receive; waiting for it gives the message on the receiver's device.
#[must_use = "a posted receive is waited for before its message is used"]
pub enum Incoming {
    Host(Work<HostBuf>, Dev),
    Nccl(InFlight, Buf),
}

impl Link {
    /// A link over the host transports of `group` (the two ranks, the sender first).
    pub fn new(group: ProcessGroup) -> Link {
        Link {
            host: group,
            nccl: None,
        }
    }

    /// The link's process group (the sender is its rank 0).
    pub fn group(&self) -> &ProcessGroup {
        &self.host
    }

    /// Moves the link's device messages onto an NCCL communicator of its two ranks on a new
    /// side stream of `gpu`; `what` names the traffic in the log. A collective over the link:
    /// both ranks call it (every rank makes its links' communicators in one global order,
    /// [`crate::executor::Pipeline::use_nccl`]).
    pub fn use_nccl(&mut self, gpu: &Arc<Gpu>, what: &str) -> Result<NcclGroup, ParallelError> {
        let stream = gpu
            .side_stream()
            .map_err(|e| ParallelError::Collective(format!("a stream for {what}: {e}")))?;
        let nccl = NcclGroup::new(&self.host, gpu, stream, what)?;
        self.nccl = Some(nccl.clone());
        Ok(nccl)
    }

    /// Whether the link's device messages travel over NCCL.
    pub fn is_nccl(&self) -> bool {
        self.nccl.is_some()
    }

    /// Starts sending `wire` (on the sender; `tag` matches it on the host transports).
    pub fn send(&self, wire: Buf, tag: u32) -> Result<Outgoing, ParallelError> {
        if let (Some(nccl), Buf::Cuda(d)) = (&self.nccl, &wire) {
            let flight = nccl.send(d.as_slice(), 1)?;
            return Ok(Outgoing::Nccl(flight, wire));
        }
        Ok(Outgoing::Host(self.host.isend(
            wire.into_host_buf()?,
            1,
            tag,
        )))
    }

    /// Posts the receive of a message of `len` elements onto `dev` (on the receiver).
    pub fn recv(&self, len: usize, dev: &Dev, tag: u32) -> Result<Incoming, ParallelError> {
        if let (Some(nccl), Dev::Cuda(gpu)) = (&self.nccl, dev) {
            let mut buf = gpu.alloc::<f32>(len).map_err(tensor::TensorError::from)?;
            let flight = nccl.recv(buf.as_mut_slice(), 0)?;
            return Ok(Incoming::Nccl(flight, Buf::Cuda(buf)));
        }
        Ok(Incoming::Host(
            self.host.irecv(dev.host_buf(len)?, 0, tag),
            dev.clone(),
        ))
    }
}

impl Outgoing {
    /// Whether the message has left (the host does not wait).
    pub fn is_done(&self) -> bool {
        match self {
            Outgoing::Host(w) => w.is_completed(),
            Outgoing::Nccl(flight, _) => flight.is_done(),
        }
    }

    /// Waits until the message left (host), or orders the compute stream after the send so
    /// that its buffer may be reused (NCCL: the host does not wait).
    pub fn wait(self) -> Result<(), ParallelError> {
        match self {
            Outgoing::Host(w) => w.wait().map(drop).map_err(ParallelError::from),
            Outgoing::Nccl(flight, _wire) => flight.join(),
        }
    }
}

impl Incoming {
    /// The message on the receiver's device: after the host received it (host), or with the
    /// compute stream ordered after its arrival (NCCL: the host does not wait).
    pub fn wait(self) -> Result<Buf, ParallelError> {
        match self {
            Incoming::Host(w, dev) => Ok(dev.from_host(w.wait()?)?),
            Incoming::Nccl(flight, wire) => {
                flight.join()?;
                Ok(wire)
            }
        }
    }
}

/// Checks that `list` (one rank's actions) sends and receives every link's micro-batches in
/// increasing order — what NCCL links need (module doc). Keys are per sending or receiving
/// stage and direction, as each such stage has one link per direction.
pub fn check_order(list: &[Action]) -> Result<(), ParallelError> {
    let mut last: HashMap<(u8, usize), usize> = HashMap::new();
    for a in list {
        let (kind, stage, mb) = match *a {
            Action::SendForward { stage, mb } => (0, stage, mb),
            Action::SendBackward { stage, mb } => (1, stage, mb),
            Action::RecvForward { stage, mb } => (2, stage, mb),
            Action::RecvBackward { stage, mb } => (3, stage, mb),
            _ => continue,
        };
        if let Some(prev) = last.insert((kind, stage), mb) {
            if prev >= mb {
                return Err(ParallelError::Schedule(format!(
                    "{a} after micro-batch {prev} on the same link: NCCL's point-to-point messages arrive in the order they were sent, so a pipeline link's micro-batches must travel in increasing order (use XTRAIN_BACKEND=own for this schedule)"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline_parallel::{generate, lower, LowerOptions, ScheduleKind};

    #[test]
    fn every_generated_schedule_sends_each_link_in_micro_batch_order() {
        let mut checked = Vec::new();
        for kind in ScheduleKind::ALL {
            let v = if kind == ScheduleKind::Interleaved {
                2
            } else {
                1
            };
            for (p, m) in [(2, 4), (4, 8), (3, 6)] {
                let Ok(s) = generate(kind, p, m, v) else {
                    continue; // a shape the kind does not support
                };
                let l = lower(&s, LowerOptions::default()).unwrap();
                for (r, list) in l.actions.iter().enumerate() {
                    check_order(list)
                        .unwrap_or_else(|e| panic!("{kind:?} p={p} m={m} rank {r}: {e}"));
                }
                checked.push(kind);
            }
        }
        checked.dedup();
        assert_eq!(
            checked,
            ScheduleKind::ALL,
            "kinds with at least one shape checked"
        );
    }

    #[test]
    fn a_link_out_of_order_is_refused_by_name() {
        let list = [
            Action::SendForward { stage: 0, mb: 1 },
            Action::SendBackward { stage: 1, mb: 0 },
            Action::SendForward { stage: 0, mb: 0 },
        ];
        let e = check_order(&list).unwrap_err().to_string();
        assert!(
            e.contains("micro-batch 1") && e.contains("XTRAIN_BACKEND=own"),
            "{e}"
        );
        // Different links (a gradient of another stage) are independent.
        check_order(&list[..2]).unwrap();
        let recv = [
            Action::RecvBackward { stage: 0, mb: 2 },
            Action::RecvBackward { stage: 0, mb: 2 },
        ];
        assert!(check_order(&recv).is_err());
    }
}
