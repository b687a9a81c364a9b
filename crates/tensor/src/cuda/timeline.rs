//! Device time per kernel: while switched on ([`Gpu::time_kernels`]), every kernel launch,
//! cuBLASLt product and copy queued on the compute stream is bracketed by two timing events,
//! and [`Gpu::kernel_times`] sums their elapsed device time by name (a kernel's
//! `module::function`, a product's format, shape and transposes, a copy's direction).
//!
//! This is the GPU's own account of a step, without the host waits of
//! `model::profile::synchronize_with` (which idles the queue between kernel classes): the
//! queue runs as in training, and each bracket measures from the moment the GPU reached the
//! first event to the moment it passed the second. Where the GPU waits for the host (a
//! launch-bound step) that wait lands in the bracket of the kernel it waited for, so the sum
//! over all kernels is at most the step's wall time, and the two agree where the GPU is the
//! bottleneck. Work on other streams (NCCL's collectives) is not bracketed.
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::driver::{check, Gpu};
use super::{sys, CudaError};

/// What a bracket timed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Timed {
    /// A kernel: module and function.
    Kernel(&'static str, &'static str),
    /// A cuBLASLt product: operand format, `[m, k, n]`, `[trans_a, trans_b]`.
    Product(&'static str, [usize; 3], [bool; 2]),
    /// A copy (or fill): "host to device", "device to host", "device to device", "memset".
    Copy(&'static str),
}

impl std::fmt::Display for Timed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Timed::Kernel(m, k) => write!(f, "{m}::{k}"),
            Timed::Product(fmt, [m, k, n], [ta, tb]) => {
                let t = |x: bool| if x { 'T' } else { 'N' };
                write!(f, "cuBLASLt {fmt} {m}x{k}x{n} ({}{})", t(*ta), t(*tb))
            }
            Timed::Copy(what) => write!(f, "copy {what}"),
        }
    }
}

/// One name's share of the device time ([`Gpu::kernel_times`]).
#[derive(Clone, Debug, PartialEq)]
pub struct KernelTime {
    pub name: String,
    pub calls: usize,
    pub seconds: f64,
}

/// The brackets of a [`Gpu`] (in its struct; empty and off until [`Gpu::time_kernels`]).
#[derive(Default)]
pub(crate) struct Timeline {
    on: AtomicBool,
    marks: Mutex<Vec<(Timed, sys::CUevent, sys::CUevent)>>,
}

impl Timeline {
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }
}

impl Gpu {
    /// Starts (`true`) or stops bracketing the compute stream's work with timing events
    /// (module docs); starting drops the brackets of an earlier run that were not read.
    pub fn time_kernels(&self, on: bool) -> Result<(), CudaError> {
        if on {
            self.take_marks()?;
        }
        self.timeline.on.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Device seconds and calls per name since [`Gpu::time_kernels`] was switched on, longest
    /// first (waits for the queue; the brackets are then released).
    pub fn kernel_times(&self) -> Result<Vec<KernelTime>, CudaError> {
        self.synchronize()?;
        let marks = self.take_marks()?;
        let mut by: HashMap<Timed, (usize, f64)> = HashMap::new();
        let mut order = Vec::new();
        for (what, ms) in marks {
            let e = by.entry(what).or_insert_with(|| {
                order.push(what);
                (0, 0.0)
            });
            e.0 += 1;
            e.1 += ms as f64 * 1e-3;
        }
        Ok(summarise(order.into_iter().map(|w| (w, by[&w]))))
    }

    /// Runs `f`, which queues `what` on the compute stream, between two timing events when
    /// timing is on.
    pub(crate) fn timed<R>(
        &self,
        what: Timed,
        f: impl FnOnce() -> Result<R, CudaError>,
    ) -> Result<R, CudaError> {
        if !self.timeline.is_on() {
            return f();
        }
        let start = self.timing_event()?;
        let r = f();
        let end = self.timing_event();
        let end = match end {
            Ok(e) => e,
            Err(e) => {
                // SAFETY: our event, not stored anywhere.
                unsafe { (self.lib.cuEventDestroy_v2)(start) };
                return Err(e);
            }
        };
        self.timeline
            .marks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push((what, start, end));
        r
    }

    /// A timing event recorded on the compute stream now.
    fn timing_event(&self) -> Result<sys::CUevent, CudaError> {
        self.bind()?;
        let mut ev: sys::CUevent = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; the event is destroyed in `take_marks` (or above).
        check(
            unsafe { (self.lib.cuEventCreate)(&mut ev, sys::CU_EVENT_DEFAULT) },
            "cuEventCreate",
        )?;
        // SAFETY: the event and the stream belong to this context.
        let r = check(
            unsafe { (self.lib.cuEventRecord)(ev, self.stream) },
            "cuEventRecord",
        );
        if let Err(e) = r {
            // SAFETY: our event, not stored anywhere.
            unsafe { (self.lib.cuEventDestroy_v2)(ev) };
            return Err(e);
        }
        Ok(ev)
    }

    /// The brackets so far as (what, milliseconds), their events released. Every event must
    /// have completed (the caller synchronised) for its time to be read; one that has not
    /// (an abandoned run) is released unread.
    pub(crate) fn take_marks(&self) -> Result<Vec<(Timed, f32)>, CudaError> {
        let marks = std::mem::take(
            &mut *self
                .timeline
                .marks
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        );
        self.bind()?;
        let mut out = Vec::with_capacity(marks.len());
        let mut failed = None;
        for (what, start, end) in marks {
            let mut ms = 0.0f32;
            // SAFETY: live events of this context, both recorded.
            let r = unsafe { (self.lib.cuEventElapsedTime)(&mut ms, start, end) };
            if r == sys::CUDA_SUCCESS {
                out.push((what, ms));
            } else if r != sys::CUDA_ERROR_NOT_READY && failed.is_none() {
                failed = Some(check(r, "cuEventElapsedTime"));
            }
            // SAFETY: ours, no longer referenced.
            unsafe {
                (self.lib.cuEventDestroy_v2)(start);
                (self.lib.cuEventDestroy_v2)(end);
            }
        }
        match failed {
            Some(Err(e)) => Err(e),
            _ => Ok(out),
        }
    }
}

/// `(what, (calls, seconds))` in first-seen order as [`KernelTime`]s, longest first (ties
/// keep the first-seen order).
fn summarise(totals: impl Iterator<Item = (Timed, (usize, f64))>) -> Vec<KernelTime> {
    let mut v: Vec<KernelTime> = totals
        .map(|(w, (calls, seconds))| KernelTime {
            name: w.to_string(),
            calls,
            seconds,
        })
        .collect();
    v.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_order_of_the_summary() {
        let k = Timed::Kernel("norm", "rmsnorm_fwd");
        let p = Timed::Product("bf16", [8192, 768, 2304], [false, true]);
        let c = Timed::Copy("host to device");
        assert_eq!(k.to_string(), "norm::rmsnorm_fwd");
        assert_eq!(p.to_string(), "cuBLASLt bf16 8192x768x2304 (NT)");
        assert_eq!(c.to_string(), "copy host to device");
        let s = summarise([(k, (24, 0.002)), (p, (36, 0.010)), (c, (2, 0.002))].into_iter());
        let names: Vec<&str> = s.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "cuBLASLt bf16 8192x768x2304 (NT)",
                "norm::rmsnorm_fwd",
                "copy host to device"
            ]
        );
        assert_eq!((s[0].calls, s[0].seconds), (36, 0.010));
    }
}
