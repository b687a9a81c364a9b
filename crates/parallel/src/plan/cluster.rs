//! The machines a plan is for: devices per node and nodes, memory and peak FLOP/s per device,
//! the fraction of the peak large products reach, memory bandwidth (the optimizer step), and
//! the two links a collective can run on (within a node, between nodes), each an alpha-beta
//! model: a message of `n` bytes takes `latency + n / bandwidth` seconds.
//!
//! Presets are data-sheet figures with the achievable bandwidths nccl-tests reports (bus
//! bandwidth of large all-reduces): A100-80G SXM (312 TFLOP/s bf16, 156 TFLOP/s tf32, NVLink 3
//! at ~240 GB/s bus bandwidth, one 200 Gb/s HDR InfiniBand rail per GPU ≈ 23 GB/s) and
//! H100-80G SXM (989 / 495 TFLOP/s, NVLink 4 ≈ 360 GB/s, one 400 Gb/s NDR rail per GPU ≈
//! 46 GB/s). `efficiency` is the share of the peak the model's products reach (0.65: large
//! bf16 GEMMs of cuBLAS on these parts run at 70-80 % of peak, attention and small kernels
//! lower). "This machine" is calibrated instead ([`Cluster::calibrated`]).
//!
//! The **host side** of a node ([`Host`], for optimizer offload) is an assumption from the
//! DGX data sheets, not a measurement: DGX A100 — 1 TiB of host memory, two 64-core EPYC 7742,
//! each GPU on its own PCIe Gen4 x16 link (32 GB/s per direction on paper, ~25 GB/s of pinned
//! copies); DGX H100 — 2 TiB, two 56-core Xeon Platinum 8480C, PCIe Gen5 x16 (64 GB/s on
//! paper, ~50 GB/s pinned). A vectorised CPU AdamW (DeepSpeed's CPU-Adam) streams about 30
//! bytes per parameter (fp32 weight, moments and gradient read, the first three written back,
//! the 16-bit weight written), so it is memory-bound: 1.5 Gparam/s per EPYC 7742 socket
//! (DDR4) and 2 Gparam/s per 8480C socket (DDR5) are assumed, shared by the node's devices.
use serde::{Deserialize, Serialize};

use crate::ParallelError;

/// One link: per-message latency (seconds) and bandwidth (bytes/s per device and direction).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Link {
    pub latency: f64,
    pub bandwidth: f64,
}

impl Link {
    /// Seconds to move `bytes` in one message.
    pub fn time(&self, bytes: f64) -> f64 {
        self.latency + bytes / self.bandwidth
    }
}

/// The host side of one node, for optimizer offload: its memory, the link between host memory
/// and each device, and the rate of its CPUs' AdamW step.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Host {
    /// Host memory per node, bytes; each device's ranks get an equal share
    /// ([`Cluster::host_share`]).
    pub memory_bytes: u64,
    /// Host ↔ device, per device and direction (default: PCIe Gen4 x16, [`Host::PCIE4`]).
    #[serde(default = "Host::pcie4")]
    pub link: Link,
    /// Parameters per second the node's CPUs update with AdamW, all its devices' shards
    /// together (default: one socket's 1.5 Gparam/s, [`Host::ADAM_PER_SOCKET_DDR4`]).
    #[serde(default = "Host::one_socket")]
    pub adam_params_per_s: f64,
}

impl Host {
    /// PCIe Gen4 x16: ~25 GB/s of pinned copies per direction, ~10 µs to launch one.
    pub const PCIE4: Link = Link {
        latency: 10e-6,
        bandwidth: 25e9,
    };
    /// PCIe Gen5 x16: ~50 GB/s per direction.
    pub const PCIE5: Link = Link {
        latency: 10e-6,
        bandwidth: 50e9,
    };
    /// A DDR4 server socket's CPU AdamW, parameters/s (see the module doc).
    pub const ADAM_PER_SOCKET_DDR4: f64 = 1.5e9;
    /// A DDR5 server socket's.
    pub const ADAM_PER_SOCKET_DDR5: f64 = 2e9;

    fn pcie4() -> Link {
        Self::PCIE4
    }
    fn one_socket() -> f64 {
        Self::ADAM_PER_SOCKET_DDR4
    }
}

/// A cluster of identical devices.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    pub name: String,
    /// The devices are GPUs (the engine's GPU backend; [`super::Job::gpu`]), not CPUs.
    #[serde(default)]
    pub gpu: bool,
    pub nodes: usize,
    pub devices_per_node: usize,
    /// Memory per device, bytes.
    pub memory_bytes: u64,
    /// Dense peak FLOP/s per device for 16-bit and for fp32 products (tf32 on GPUs).
    pub peak_flops_16: f64,
    pub peak_flops_32: f64,
    /// Share of the peak the model's compute reaches.
    pub efficiency: f64,
    /// Device memory bandwidth, bytes/s (the optimizer step is bound by it).
    pub memory_bandwidth: f64,
    /// Between devices of one node.
    pub intra: Link,
    /// Between nodes.
    pub inter: Link,
    /// Resident bytes of a rank's process besides its model, its buffers and its workspace:
    /// the binary, libraries and runtime. 0 in the GPU presets (device memory holds none of
    /// it; a CUDA context and library workspaces are not counted); this machine's is the
    /// planning process's own resident set, the same binary before it builds a model.
    #[serde(default)]
    pub process_bytes: u64,
    /// Bytes a rank maps for each peer of each communication group it joins (the
    /// shared-memory transport's two rings); 0 in the GPU presets.
    #[serde(default)]
    pub group_peer_bytes: u64,
    /// The nodes' host side; absent, optimizer offload is not planned (this machine's
    /// devices are its host).
    #[serde(default)]
    pub host: Option<Host>,
}

const GIB: u64 = 1 << 30;

impl Cluster {
    /// The preset called `name` (`a100-80g`, `h100-80g`) with `nodes` nodes of 8 devices.
    pub fn preset(name: &str, nodes: usize) -> Result<Self, ParallelError> {
        let mut c = match name.to_ascii_lowercase().as_str() {
            "a100-80g" | "a100" => Cluster {
                name: "A100-80G".into(),
                gpu: true,
                nodes: 1,
                devices_per_node: 8,
                memory_bytes: 80 * GIB,
                peak_flops_16: 312e12,
                peak_flops_32: 156e12,
                efficiency: 0.65,
                memory_bandwidth: 2.0e12,
                intra: Link {
                    latency: 5e-6,
                    bandwidth: 240e9,
                },
                inter: Link {
                    latency: 10e-6,
                    bandwidth: 23e9,
                },
                process_bytes: 0,
                group_peer_bytes: 0,
                host: Some(Host {
                    memory_bytes: 1024 * GIB,
                    link: Host::PCIE4,
                    adam_params_per_s: 2.0 * Host::ADAM_PER_SOCKET_DDR4,
                }),
            },
            "h100-80g" | "h100" => Cluster {
                name: "H100-80G".into(),
                gpu: true,
                nodes: 1,
                devices_per_node: 8,
                memory_bytes: 80 * GIB,
                peak_flops_16: 989e12,
                peak_flops_32: 495e12,
                efficiency: 0.65,
                memory_bandwidth: 3.35e12,
                intra: Link {
                    latency: 4e-6,
                    bandwidth: 360e9,
                },
                inter: Link {
                    latency: 8e-6,
                    bandwidth: 46e9,
                },
                process_bytes: 0,
                group_peer_bytes: 0,
                host: Some(Host {
                    memory_bytes: 2048 * GIB,
                    link: Host::PCIE5,
                    adam_params_per_s: 2.0 * Host::ADAM_PER_SOCKET_DDR5,
                }),
            },
            other => {
                return Err(ParallelError::Config(format!(
                    "unknown cluster `{other}` (known: a100-80g, h100-80g, this; or a JSON file)"
                )))
            }
        };
        if nodes == 0 {
            return Err(ParallelError::Config(
                "a cluster needs at least one node".into(),
            ));
        }
        c.nodes = nodes;
        Ok(c)
    }

    /// A cluster read from JSON (the fields of this struct).
    pub fn from_json(text: &str) -> Result<Self, ParallelError> {
        let c: Cluster = serde_json::from_str(text)
            .map_err(|e| ParallelError::Config(format!("cluster JSON: {e}")))?;
        c.check()?;
        Ok(c)
    }

    /// A one-node cluster of `devices` processes on this machine: `peak_flops` is the measured
    /// fp32 GEMM peak of one process's thread budget (the engine computes in fp32 whatever the
    /// storage precision), `efficiency` the share of it a training step reaches, the links
    /// the measured shared-memory transport.
    pub fn calibrated(
        devices: usize,
        memory_bytes: u64,
        peak_flops: f64,
        efficiency: f64,
        memory_bandwidth: f64,
        link: Link,
    ) -> Self {
        Cluster {
            name: "this machine".into(),
            gpu: false,
            nodes: 1,
            devices_per_node: devices,
            memory_bytes,
            peak_flops_16: peak_flops,
            peak_flops_32: peak_flops,
            efficiency,
            memory_bandwidth,
            intra: link,
            inter: link,
            process_bytes: 0,
            group_peer_bytes: 0,
            host: None,
        }
    }

    /// Every figure positive and finite (a link's latency may be 0).
    pub fn check(&self) -> Result<(), ParallelError> {
        let mut pos = vec![
            ("peak_flops_16", self.peak_flops_16),
            ("peak_flops_32", self.peak_flops_32),
            ("efficiency", self.efficiency),
            ("memory_bandwidth", self.memory_bandwidth),
            ("intra.bandwidth", self.intra.bandwidth),
            ("inter.bandwidth", self.inter.bandwidth),
        ];
        if let Some(h) = &self.host {
            pos.extend([
                ("host.memory_bytes", h.memory_bytes as f64),
                ("host.link.bandwidth", h.link.bandwidth),
                ("host.adam_params_per_s", h.adam_params_per_s),
            ]);
            if !(h.link.latency.is_finite() && h.link.latency >= 0.0) {
                return Err(ParallelError::Config(format!(
                    "cluster host.link.latency = {} must be 0 or more",
                    h.link.latency
                )));
            }
        }
        for (name, v) in pos {
            if !(v.is_finite() && v > 0.0) {
                return Err(ParallelError::Config(format!(
                    "cluster {name} = {v} must be a positive number"
                )));
            }
        }
        if self.nodes == 0 || self.devices_per_node == 0 || self.memory_bytes == 0 {
            return Err(ParallelError::Config(
                "a cluster needs nodes, devices per node and memory per device".into(),
            ));
        }
        Ok(())
    }

    /// Devices in all.
    pub fn devices(&self) -> usize {
        self.nodes * self.devices_per_node
    }

    /// Host memory per device (the node's over its devices), bytes; `None` without a host side.
    pub fn host_share(&self) -> Option<u64> {
        self.host
            .map(|h| h.memory_bytes / self.devices_per_node as u64)
    }

    /// The link a group of `size` ranks `stride` apart on the world (ranks laid out node by
    /// node) runs on: within a node when it fits in one, else between nodes (a ring that
    /// crosses nodes is as fast as its slowest hop).
    pub fn link(&self, size: usize, stride: usize) -> Link {
        if size <= 1 || size * stride <= self.devices_per_node {
            self.intra
        } else {
            self.inter
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_side_defaults_and_checks() {
        let h100 = Cluster::preset("h100-80g", 1).unwrap();
        assert_eq!(h100.host_share(), Some(256 * GIB));
        assert!(Cluster::calibrated(2, GIB, 1e9, 0.5, 1e9, Host::PCIE4)
            .host_share()
            .is_none());
        // A JSON cluster without a host side plans no offload; with only its memory, the
        // link and the AdamW rate take their defaults.
        let mut v = serde_json::to_value(&h100).unwrap();
        v.as_object_mut().unwrap().remove("host");
        assert_eq!(Cluster::from_json(&v.to_string()).unwrap().host, None);
        v["host"] = serde_json::json!({ "memory_bytes": 128u64 << 30 });
        let host = Cluster::from_json(&v.to_string()).unwrap().host.unwrap();
        assert_eq!(host.link, Host::PCIE4);
        assert_eq!(host.adam_params_per_s, Host::ADAM_PER_SOCKET_DDR4);
        for bad in [
            serde_json::json!({ "memory_bytes": 0 }),
            serde_json::json!({ "memory_bytes": 1, "adam_params_per_s": -1.0 }),
            serde_json::json!({ "memory_bytes": 1, "link": { "latency": -1.0, "bandwidth": 1.0 } }),
        ] {
            v["host"] = bad;
            let err = Cluster::from_json(&v.to_string()).unwrap_err().to_string();
            assert!(err.contains("cluster host."), "{err}");
        }
    }
}
