//! NCCL for the data-parallel gradient reductions of ranks that each have their own GPU
//! (`XTRAIN_BACKEND=nccl`): a bucket of fp32 gradients (or the fp32 copy of a 16-bit bucket)
//! is all-reduced in place on the device, on the compute stream, and scaled by `1/dp` — no
//! trip through host memory. Everything else of the executor (ZeRO-2/3's reduce-scatter, the
//! weight gathers, compressed reductions, pipeline messages, the model's collectives) keeps
//! the communicator's collectives over host memory (`XTRAIN_BACKEND=own`, the default, or
//! `mpi`).
//!
//! The communicator is made over the dp group itself: every rank reports its host and GPU
//! (NCCL needs one GPU per rank, so ranks sharing one are refused by name before NCCL is
//! asked), rank 0 makes the unique id and broadcasts it over the group's authenticated host
//! transport, and every rank joins.
use std::sync::{Arc, Mutex};

use comm::ProcessGroup;
use tensor::buf::BufMut;
use tensor::cuda::{Gpu, NcclComm, NcclId, ReduceOp};

use crate::ParallelError;

/// Environment variable choosing the data-parallel backend of GPU ranks.
pub const BACKEND_ENV: &str = "XTRAIN_BACKEND";

/// The data-parallel backend of GPU ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Through host memory, on the collectives of the communicator (`XTRAIN_BACKEND` `own`
    /// or `mpi`: any number of ranks per GPU).
    Host,
    /// NCCL on the device (`XTRAIN_BACKEND=nccl`: one GPU per rank).
    Nccl,
}

impl Backend {
    /// From `XTRAIN_BACKEND` (unset: through host memory).
    pub fn from_env() -> Result<Backend, ParallelError> {
        Backend::parse(&std::env::var(BACKEND_ENV).unwrap_or_default())
    }

    /// `own`, `mpi` (the host collectives' library) or `nccl` (empty: `own`).
    pub fn parse(v: &str) -> Result<Backend, ParallelError> {
        match v.trim().to_ascii_lowercase().as_str() {
            "" | "own" | "mpi" => Ok(Backend::Host),
            "nccl" => Ok(Backend::Nccl),
            other => Err(ParallelError::Config(format!(
                "{BACKEND_ENV}={other}: expected own, mpi or nccl"
            ))),
        }
    }
}

/// An NCCL communicator over a dp group (shared by the executor's clones of its config).
#[derive(Clone)]
pub struct NcclGroup {
    comm: Arc<Mutex<NcclComm>>,
    size: usize,
}

impl std::fmt::Debug for NcclGroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclGroup({} ranks)", self.size)
    }
}

fn cuda_err(e: tensor::cuda::CudaError) -> ParallelError {
    ParallelError::Model(format!("NCCL: {e}"))
}

/// This machine's name (ranks on one host with the same GPU ordinal share that GPU).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// A 64-bit FNV-1a hash of `s` (the host name travels as one integer).
fn fnv1a(s: &str) -> i64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    }) as i64
}

impl NcclGroup {
    /// Joins every rank of `dp` (each on its `gpu`) into one NCCL communicator. A
    /// collective over `dp`: every rank calls it.
    pub fn new(dp: &ProcessGroup, gpu: &Arc<Gpu>) -> Result<NcclGroup, ParallelError> {
        let (n, me) = (dp.size(), dp.rank());
        let mine = [fnv1a(&host_name()), gpu.info.ordinal as i64];
        let mut all = vec![0i64; 2 * n];
        dp.all_gather(&mine, &mut all)?;
        for a in 0..n {
            for b in a + 1..n {
                if all[2 * a..2 * a + 2] == all[2 * b..2 * b + 2] {
                    return Err(ParallelError::Config(format!(
                        "{BACKEND_ENV}=nccl needs one GPU per rank, but dp ranks {a} and {b} share cuda:{} on one host (start at most as many ranks per host as it has GPUs, or use {BACKEND_ENV}=own)",
                        all[2 * a + 1]
                    )));
                }
            }
        }
        // The id as 16 words over the group's own (authenticated) transport.
        let mut words = [0i64; NcclId::BYTES / 8];
        if me == 0 {
            let id = NcclId::new().map_err(cuda_err)?;
            for (w, c) in words.iter_mut().zip(id.as_bytes().chunks_exact(8)) {
                *w = i64::from_le_bytes(c.try_into().expect("8 bytes"));
            }
        }
        dp.broadcast(&mut words, 0)?;
        let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let id = NcclId::from_bytes(&bytes).map_err(cuda_err)?;
        let comm = NcclComm::init(gpu, &id, n, me).map_err(cuda_err)?;
        tracing::info!(target: "comm", "dp group of {n} ranks: gradients over NCCL on cuda:{}", gpu.info.ordinal);
        Ok(NcclGroup {
            comm: Arc::new(Mutex::new(comm)),
            size: n,
        })
    }

    /// `g ← mean over the ranks of g`, in place on the device (fp32): NCCL's sum, then
    /// `· 1/n` (the own engine's order of operations, so the rounding rule is the same).
    pub fn all_reduce_mean(&self, mut g: BufMut<'_>) -> Result<(), ParallelError> {
        let BufMut::Cuda(s) = g.reborrow() else {
            return Err(ParallelError::Model(
                "NCCL reduces GPU buffers; this gradient bucket is on the host".into(),
            ));
        };
        self.comm
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .all_reduce_in_place(s, ReduceOp::Sum)
            .map_err(cuda_err)?;
        tensor::ops::scale(g, 1.0 / self.size as f32)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backends_parse_and_hosts_hash_apart() {
        assert_eq!(Backend::parse("").unwrap(), Backend::Host);
        assert_eq!(Backend::parse(" OWN ").unwrap(), Backend::Host);
        assert_eq!(Backend::parse("mpi").unwrap(), Backend::Host);
        assert_eq!(Backend::parse("nccl").unwrap(), Backend::Nccl);
        let e = Backend::parse("gloo").unwrap_err().to_string();
        assert!(
            e.contains("XTRAIN_BACKEND=gloo") && e.contains("own, mpi or nccl"),
            "{e}"
        );
        assert_ne!(fnv1a("node-a"), fnv1a("node-b"));
        assert_eq!(fnv1a("node-a"), fnv1a("node-a"));
    }
}
