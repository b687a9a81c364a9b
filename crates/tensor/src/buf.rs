//! Buffers on a device: host memory or a GPU's ([`Buf`]), borrowed whole or as a range
//! ([`BufRef`], [`BufMut`]), and the device they live on ([`Dev`]). The engine's activations,
//! caches and flat parameter / gradient buffers are `Buf`s, so one model runs on either device;
//! [`crate::ops`] dispatches each kernel to the CPU implementation or its CUDA twin.
//!
//! Host buffers are plain vectors: on the CPU every operation is the CPU kernel on the same
//! slices as before, bit for bit. Code that needs host data asks for it explicitly: a
//! collective or message over the host transports stages it ([`HostBuf`]: the vector itself on
//! the CPU, page-locked scratch from a GPU; [`Buf::into_host_buf`], [`Dev::from_host`]),
//! checkpoints copy it ([`BufRef::to_vec`]), and host-only code borrows it ([`Buf::as_host`]:
//! a device buffer there is an error naming the operation, never a silent copy).

use crate::cuda::{DevBuf, DevSlice, DevSliceMut, Gpu};
use crate::TensorError;
use std::ops::Range;
use std::sync::Arc;

/// Where buffers live: the host, or an opened GPU.
#[derive(Clone, Debug)]
pub enum Dev {
    Cpu,
    Cuda(Arc<Gpu>),
}

/// Host memory through which a device's buffers are staged for the host transports (a
/// collective, a pipeline message): an ordinary vector for the CPU (a host buffer's own
/// allocation where one is handed over: no copy), page-locked scratch of the GPU's pool for a
/// GPU ([`crate::cuda::HostScratch`]: the copy engine reads and writes it directly, at the
/// link's speed, and the collective works on it in place). A slice either way.
#[derive(Debug)]
pub enum HostBuf<T: Copy = f32> {
    Vec(Vec<T>),
    Pinned(crate::cuda::HostScratch<T>),
}

impl<T: Copy> HostBuf<T> {
    /// The values as a vector: the vector itself, or a copy of the scratch.
    pub fn into_vec(self) -> Vec<T> {
        match self {
            HostBuf::Vec(v) => v,
            HostBuf::Pinned(p) => p.to_vec(),
        }
    }
}

impl<T: Copy> std::ops::Deref for HostBuf<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        match self {
            HostBuf::Vec(v) => v,
            HostBuf::Pinned(p) => p,
        }
    }
}

impl<T: Copy> std::ops::DerefMut for HostBuf<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        match self {
            HostBuf::Vec(v) => v,
            HostBuf::Pinned(p) => p,
        }
    }
}

impl<T: Copy> AsRef<[T]> for HostBuf<T> {
    fn as_ref(&self) -> &[T] {
        self
    }
}

impl<T: Copy> AsMut<[T]> for HostBuf<T> {
    fn as_mut(&mut self) -> &mut [T] {
        self
    }
}

/// Environment variable choosing the device (`cpu`, `cuda`, `cuda:N`).
pub const DEVICE_ENV: &str = "XTRAIN_DEVICE";

impl Dev {
    /// Parses `cpu`, `cuda` (device 0) or `cuda:N` and opens the GPU (a clear error where there
    /// is none).
    pub fn open(spec: &str) -> Result<Dev, TensorError> {
        let s = spec.trim().to_ascii_lowercase();
        if s == "cpu" {
            return Ok(Dev::Cpu);
        }
        let ordinal = match s.strip_prefix("cuda") {
            Some("") => 0,
            Some(rest) => rest
                .strip_prefix(':')
                .and_then(|n| n.parse::<usize>().ok())
                .ok_or_else(|| bad_spec(spec))?,
            None => return Err(bad_spec(spec)),
        };
        Ok(Dev::Cuda(Gpu::open(ordinal)?))
    }

    /// [`Dev::open`] for the `local_rank`-th process of a host: `cuda` without an ordinal
    /// opens GPU `local_rank mod (GPUs on the host)` — one GPU per rank where there are enough,
    /// ranks sharing them round-robin where there are not (torchrun's `LOCAL_RANK`
    /// convention) — and `cuda:N` opens GPU `N` whatever the rank.
    pub fn open_local(spec: &str, local_rank: usize) -> Result<Dev, TensorError> {
        if spec.trim().eq_ignore_ascii_case("cuda") {
            let count = crate::cuda::device_count()?;
            if count == 0 {
                return Dev::open(spec);
            }
            return Dev::open(&format!("cuda:{}", local_rank % count));
        }
        Dev::open(spec)
    }

    /// The device `XTRAIN_DEVICE` names, or the CPU when it is unset.
    pub fn from_env() -> Result<Dev, TensorError> {
        match std::env::var(DEVICE_ENV) {
            Ok(v) if !v.trim().is_empty() => Dev::open(&v),
            _ => Ok(Dev::Cpu),
        }
    }

    /// `cpu` or `cuda:N`.
    pub fn name(&self) -> String {
        match self {
            Dev::Cpu => "cpu".into(),
            Dev::Cuda(g) => format!("cuda:{}", g.info.ordinal),
        }
    }

    pub fn is_cuda(&self) -> bool {
        matches!(self, Dev::Cuda(_))
    }

    /// `n` zeros on this device.
    pub fn zeros(&self, n: usize) -> Result<Buf, TensorError> {
        Ok(match self {
            Dev::Cpu => Buf::Host(crate::threads::zeros(n)),
            Dev::Cuda(g) => Buf::Cuda(g.zeros(n)?),
        })
    }

    /// `n` zeros in host memory for staging this device's buffers ([`HostBuf`]):
    /// page-locked for a GPU, an ordinary vector for the CPU.
    pub fn host_zeros<T: Copy + Default>(&self, n: usize) -> Result<HostBuf<T>, TensorError> {
        let mut h = self.host_buf(n)?;
        if let HostBuf::Pinned(p) = &mut h {
            p.fill(T::default());
        }
        Ok(h)
    }

    /// `n` elements of host memory for staging this device's buffers, to be written whole
    /// (a receive, a collective's output): zeros on the CPU; on a GPU page-locked scratch
    /// holding what its last lease left.
    pub fn host_buf<T: Copy + Default>(&self, n: usize) -> Result<HostBuf<T>, TensorError> {
        Ok(match self {
            Dev::Cpu => HostBuf::Vec(vec![T::default(); n]),
            Dev::Cuda(g) => HostBuf::Pinned(g.host_scratch(n)?),
        })
    }

    /// Staged values `h` as a buffer on this device: the vector itself on the CPU, uploaded
    /// to a GPU (one DMA from page-locked scratch).
    pub fn from_host(&self, h: HostBuf) -> Result<Buf, TensorError> {
        Ok(match (self, h) {
            (Dev::Cpu, h) => Buf::Host(h.into_vec()),
            (Dev::Cuda(g), h) => Buf::Cuda(g.upload(&h)?),
        })
    }

    /// `v` on this device (moved on the host, copied to a GPU).
    pub fn from_vec(&self, v: Vec<f32>) -> Result<Buf, TensorError> {
        Ok(match self {
            Dev::Cpu => Buf::Host(v),
            Dev::Cuda(g) => Buf::Cuda(g.upload(&v)?),
        })
    }
}

fn bad_spec(spec: &str) -> TensorError {
    TensorError::Config(format!("device `{spec}`: expected cpu, cuda or cuda:N"))
}

/// An `f32` buffer on a device.
#[derive(Debug)]
pub enum Buf {
    Host(Vec<f32>),
    Cuda(DevBuf<f32>),
}

/// A borrowed range of a [`Buf`].
#[derive(Clone, Copy)]
pub enum BufRef<'a> {
    Host(&'a [f32]),
    Cuda(DevSlice<'a, f32>),
}

/// A mutably borrowed range of a [`Buf`].
pub enum BufMut<'a> {
    Host(&'a mut [f32]),
    Cuda(DevSliceMut<'a, f32>),
}

/// The error of host-only code given a device buffer.
pub(crate) fn not_host(what: &str) -> TensorError {
    TensorError::Device(format!(
        "{what} runs on host buffers; this buffer is on the GPU"
    ))
}

impl Buf {
    pub fn len(&self) -> usize {
        match self {
            Buf::Host(v) => v.len(),
            Buf::Cuda(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * self.len()
    }

    pub fn is_cuda(&self) -> bool {
        matches!(self, Buf::Cuda(_))
    }

    /// The device of the buffer.
    pub fn dev(&self) -> Dev {
        match self {
            Buf::Host(_) => Dev::Cpu,
            Buf::Cuda(b) => Dev::Cuda(b.gpu().clone()),
        }
    }

    /// The whole buffer, borrowed.
    pub fn r(&self) -> BufRef<'_> {
        match self {
            Buf::Host(v) => BufRef::Host(v),
            Buf::Cuda(b) => BufRef::Cuda(b.as_slice()),
        }
    }

    /// The whole buffer, mutably borrowed.
    pub fn m(&mut self) -> BufMut<'_> {
        match self {
            Buf::Host(v) => BufMut::Host(v),
            Buf::Cuda(b) => BufMut::Cuda(b.as_mut_slice()),
        }
    }

    /// The host data (an error for a GPU buffer, naming `what` needed it).
    pub fn as_host(&self, what: &str) -> Result<&[f32], TensorError> {
        match self {
            Buf::Host(v) => Ok(v),
            Buf::Cuda(_) => Err(not_host(what)),
        }
    }

    /// The host data, mutably (an error for a GPU buffer).
    pub fn as_host_mut(&mut self, what: &str) -> Result<&mut [f32], TensorError> {
        match self {
            Buf::Host(v) => Ok(v),
            Buf::Cuda(_) => Err(not_host(what)),
        }
    }

    /// The host vector (an error for a GPU buffer).
    pub fn into_host(self, what: &str) -> Result<Vec<f32>, TensorError> {
        match self {
            Buf::Host(v) => Ok(v),
            Buf::Cuda(_) => Err(not_host(what)),
        }
    }

    /// A host copy (downloaded from a GPU).
    pub fn to_vec(&self) -> Result<Vec<f32>, TensorError> {
        self.r().to_vec()
    }

    /// The data on the host: the vector itself, or downloaded from a GPU.
    pub fn into_vec(self) -> Result<Vec<f32>, TensorError> {
        match self {
            Buf::Host(v) => Ok(v),
            Buf::Cuda(b) => Ok(b.to_host()?),
        }
    }

    /// The values in host memory for the host transports ([`HostBuf`]): the vector itself
    /// on the CPU; from a GPU downloaded into page-locked scratch of its pool.
    pub fn into_host_buf(self) -> Result<HostBuf, TensorError> {
        match self {
            Buf::Host(v) => Ok(HostBuf::Vec(v)),
            Buf::Cuda(d) => Ok(HostBuf::Pinned(d.as_slice().to_scratch()?)),
        }
    }

    /// `f` run in place on the buffer's values in host memory: how host-only code (a
    /// collective over the host transports) serves a device buffer. The vector itself on the
    /// CPU; on a GPU the values go down into page-locked scratch of the GPU's pool
    /// ([`crate::cuda::Gpu::host_scratch`]: one DMA each way, no copy through ordinary
    /// memory), `f` runs on the scratch, and the result goes back up into the buffer.
    pub fn on_host<E: From<TensorError>>(
        mut self,
        f: impl FnOnce(&mut [f32]) -> Result<(), E>,
    ) -> Result<Buf, E> {
        match &mut self {
            Buf::Host(v) => f(v)?,
            Buf::Cuda(d) => {
                let mut s = d.as_slice().to_scratch().map_err(TensorError::from)?;
                f(&mut s)?;
                d.copy_from_host(&s).map_err(TensorError::from)?;
            }
        }
        Ok(self)
    }

    /// `f(values, out)` in host memory with `out` of `out_len` elements (zeroed on the CPU;
    /// on a GPU page-locked scratch as in [`Buf::on_host`], its prior contents left): the
    /// result a new buffer on this buffer's device. For collectives whose output differs in
    /// length from their input (all-gather, reduce-scatter).
    pub fn on_host_into<E: From<TensorError>>(
        self,
        out_len: usize,
        f: impl FnOnce(&[f32], &mut [f32]) -> Result<(), E>,
    ) -> Result<Buf, E> {
        let dev = self.dev();
        let input = self.into_host_buf()?;
        let mut out = dev.host_buf(out_len)?;
        f(&input, &mut out)?;
        drop(input);
        Ok(dev.from_host(out)?)
    }

    /// A copy on the same device.
    pub fn try_clone(&self) -> Result<Buf, TensorError> {
        Ok(match self {
            Buf::Host(v) => Buf::Host(v.clone()),
            Buf::Cuda(b) => {
                let mut c = b.gpu().alloc::<f32>(b.len())?;
                c.as_mut_slice().copy_from(b.as_slice())?;
                Buf::Cuda(c)
            }
        })
    }
}

impl From<Vec<f32>> for Buf {
    fn from(v: Vec<f32>) -> Buf {
        Buf::Host(v)
    }
}

impl<'a> From<&'a Buf> for BufRef<'a> {
    fn from(b: &'a Buf) -> BufRef<'a> {
        b.r()
    }
}

impl<'a> From<&'a [f32]> for BufRef<'a> {
    fn from(s: &'a [f32]) -> BufRef<'a> {
        BufRef::Host(s)
    }
}

impl<'a> From<&'a Vec<f32>> for BufRef<'a> {
    fn from(s: &'a Vec<f32>) -> BufRef<'a> {
        BufRef::Host(s)
    }
}

impl<'a> From<&'a mut [f32]> for BufMut<'a> {
    fn from(s: &'a mut [f32]) -> BufMut<'a> {
        BufMut::Host(s)
    }
}

impl<'a> From<&'a mut Vec<f32>> for BufMut<'a> {
    fn from(s: &'a mut Vec<f32>) -> BufMut<'a> {
        BufMut::Host(s)
    }
}

impl<'a> From<&'a mut Buf> for BufMut<'a> {
    fn from(b: &'a mut Buf) -> BufMut<'a> {
        b.m()
    }
}

impl<'a> BufRef<'a> {
    pub fn len(&self) -> usize {
        match self {
            BufRef::Host(s) => s.len(),
            BufRef::Cuda(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The sub-range `r` (panics beyond the end, as slicing does).
    pub fn slice(self, r: Range<usize>) -> BufRef<'a> {
        match self {
            BufRef::Host(s) => BufRef::Host(&s[r]),
            BufRef::Cuda(s) => BufRef::Cuda(s.slice(r)),
        }
    }

    /// The device of the range.
    pub fn dev(&self) -> Dev {
        match self {
            BufRef::Host(_) => Dev::Cpu,
            BufRef::Cuda(s) => Dev::Cuda(s.gpu().clone()),
        }
    }

    /// The host data (an error for a GPU range).
    pub fn as_host(self, what: &str) -> Result<&'a [f32], TensorError> {
        match self {
            BufRef::Host(s) => Ok(s),
            BufRef::Cuda(_) => Err(not_host(what)),
        }
    }

    /// A host copy (downloaded from a GPU).
    pub fn to_vec(self) -> Result<Vec<f32>, TensorError> {
        match self {
            BufRef::Host(s) => Ok(s.to_vec()),
            BufRef::Cuda(s) => Ok(s.to_host()?),
        }
    }

    /// The range's values in host memory for the host transports ([`HostBuf`]): a copy in a
    /// vector on the CPU; from a GPU downloaded into page-locked scratch of its pool.
    pub fn to_host_buf(self) -> Result<HostBuf, TensorError> {
        match self {
            BufRef::Host(s) => Ok(HostBuf::Vec(s.to_vec())),
            BufRef::Cuda(s) => Ok(HostBuf::Pinned(s.to_scratch()?)),
        }
    }

    /// Copies the range into host slice `out` (same length; downloaded from a GPU).
    pub fn read_into(self, out: &mut [f32]) -> Result<(), TensorError> {
        crate::error::check_len("read_into", out.len(), self.len())?;
        match self {
            BufRef::Host(s) => out.copy_from_slice(s),
            BufRef::Cuda(s) => s.read_into(out)?,
        }
        Ok(())
    }

    /// A new buffer holding a copy of the range, on its device.
    pub fn to_buf(self) -> Result<Buf, TensorError> {
        Ok(match self {
            BufRef::Host(s) => Buf::Host(s.to_vec()),
            BufRef::Cuda(s) => {
                let mut c = s.gpu().alloc::<f32>(s.len())?;
                c.as_mut_slice().copy_from(s)?;
                Buf::Cuda(c)
            }
        })
    }
}

impl<'a> BufMut<'a> {
    pub fn len(&self) -> usize {
        match self {
            BufMut::Host(s) => s.len(),
            BufMut::Cuda(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A shorter-lived mutable borrow of the same range.
    pub fn reborrow(&mut self) -> BufMut<'_> {
        match self {
            BufMut::Host(s) => BufMut::Host(s),
            BufMut::Cuda(s) => BufMut::Cuda(s.reborrow()),
        }
    }

    /// A read-only borrow of the same range.
    pub fn as_ref(&self) -> BufRef<'_> {
        match self {
            BufMut::Host(s) => BufRef::Host(s),
            BufMut::Cuda(s) => BufRef::Cuda(s.as_ref()),
        }
    }

    /// The sub-range `r` (panics beyond the end).
    pub fn slice_mut(self, r: Range<usize>) -> BufMut<'a> {
        match self {
            BufMut::Host(s) => BufMut::Host(&mut s[r]),
            BufMut::Cuda(s) => BufMut::Cuda(s.slice_mut(r)),
        }
    }

    /// The range cut in two at `mid` (panics beyond the end).
    pub fn split_at_mut(self, mid: usize) -> (BufMut<'a>, BufMut<'a>) {
        match self {
            BufMut::Host(s) => {
                let (a, b) = s.split_at_mut(mid);
                (BufMut::Host(a), BufMut::Host(b))
            }
            BufMut::Cuda(s) => {
                let (a, b) = s.split_at(mid);
                (BufMut::Cuda(a), BufMut::Cuda(b))
            }
        }
    }

    /// The host data (an error for a GPU range).
    pub fn as_host(self, what: &str) -> Result<&'a mut [f32], TensorError> {
        match self {
            BufMut::Host(s) => Ok(s),
            BufMut::Cuda(_) => Err(not_host(what)),
        }
    }

    /// Overwrites the range with `src` (same length, same device).
    pub fn copy_from(&mut self, src: BufRef<'_>) -> Result<(), TensorError> {
        match (self, src) {
            (BufMut::Host(d), BufRef::Host(s)) => {
                crate::error::check_len("copy_from", s.len(), d.len())?;
                d.copy_from_slice(s);
                Ok(())
            }
            (BufMut::Cuda(d), BufRef::Cuda(s)) => Ok(d.copy_from(s)?),
            _ => Err(mixed("copy_from")),
        }
    }

    /// Overwrites the range with host values `src` (same length; uploaded to a GPU): the
    /// explicit host → device staging of the paths that compute on the host.
    pub fn copy_from_host(&mut self, src: &[f32]) -> Result<(), TensorError> {
        crate::error::check_len("copy_from_host", src.len(), self.len())?;
        match self {
            BufMut::Host(d) => d.copy_from_slice(src),
            BufMut::Cuda(d) => d.copy_from_host(src)?,
        }
        Ok(())
    }

    /// Sets every element to zero.
    pub fn zero(&mut self) -> Result<(), TensorError> {
        match self {
            BufMut::Host(s) => {
                s.fill(0.0);
                Ok(())
            }
            BufMut::Cuda(s) => Ok(s.zero()?),
        }
    }
}

/// The error of an operation given buffers on different devices.
pub(crate) fn mixed(what: &str) -> TensorError {
    TensorError::Device(format!("{what}: buffers on different devices"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_buffers_borrow_slice_and_refuse_nothing() {
        let mut b = Buf::from(vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(b.r().slice(1..3).to_vec().unwrap(), vec![2.0, 3.0]);
        b.m().slice_mut(0..2).zero().unwrap();
        assert_eq!(b.as_host("test").unwrap(), &[0.0, 0.0, 3.0, 4.0]);
        let mut c = Dev::Cpu.zeros(2).unwrap();
        c.m().copy_from(b.r().slice(2..4)).unwrap();
        assert_eq!(c.to_vec().unwrap(), vec![3.0, 4.0]);
        assert!(c.m().copy_from(b.r()).is_err(), "lengths differ");
        c.m().copy_from_host(&[7.0, 8.0]).unwrap();
        let mut out = [0.0; 2];
        c.r().read_into(&mut out).unwrap();
        assert_eq!(out, [7.0, 8.0]);
        assert!(c.m().copy_from_host(&[1.0]).is_err(), "lengths differ");
        let d = c
            .on_host(|v| {
                v.iter_mut().for_each(|x| *x *= 2.0);
                Ok::<_, TensorError>(())
            })
            .unwrap();
        assert_eq!(d.as_host("test").unwrap(), &[14.0, 16.0]);
        let e = d
            .on_host_into(3, |v, out| {
                out[..2].copy_from_slice(v);
                out[2] = v[0] + v[1];
                Ok::<_, TensorError>(())
            })
            .unwrap();
        assert_eq!(e.as_host("test").unwrap(), &[14.0, 16.0, 30.0]);
        assert!(e.r().read_into(&mut [0.0; 2]).is_err(), "lengths differ");
    }

    #[test]
    fn device_specs_parse_or_are_clear_errors() {
        assert!(matches!(Dev::open("cpu"), Ok(Dev::Cpu)));
        for bad in ["gpu", "cuda:x", "cuda0", "tpu:1"] {
            let e = Dev::open(bad).unwrap_err().to_string();
            assert!(e.contains("expected cpu, cuda or cuda:N"), "{bad}: {e}");
        }
        assert!(matches!(Dev::open_local("cpu", 3), Ok(Dev::Cpu)));
        assert!(Dev::open_local("cuda:x", 0).is_err());
        // Without a GPU, asking for one names what is missing.
        if crate::cuda::device_count().is_err() {
            for e in [Dev::open("cuda"), Dev::open_local("cuda", 1)] {
                let e = e.unwrap_err().to_string();
                assert!(e.contains("driver") || e.contains("GPU"), "{e}");
            }
        }
    }
}
