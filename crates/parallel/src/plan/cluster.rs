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

/// A cluster of identical devices.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    pub name: String,
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
}

const GIB: u64 = 1 << 30;

impl Cluster {
    /// The preset called `name` (`a100-80g`, `h100-80g`) with `nodes` nodes of 8 devices.
    pub fn preset(name: &str, nodes: usize) -> Result<Self, ParallelError> {
        let mut c = match name.to_ascii_lowercase().as_str() {
            "a100-80g" | "a100" => Cluster {
                name: "A100-80G".into(),
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
            },
            "h100-80g" | "h100" => Cluster {
                name: "H100-80G".into(),
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
        }
    }

    /// Every figure positive and finite.
    pub fn check(&self) -> Result<(), ParallelError> {
        let pos = [
            ("peak_flops_16", self.peak_flops_16),
            ("peak_flops_32", self.peak_flops_32),
            ("efficiency", self.efficiency),
            ("memory_bandwidth", self.memory_bandwidth),
            ("intra.bandwidth", self.intra.bandwidth),
            ("inter.bandwidth", self.inter.bandwidth),
        ];
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
