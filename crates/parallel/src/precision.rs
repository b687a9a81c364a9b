//! Numeric precision of a training run, on every layout: the [`Precision`] setting, the 16-bit
//! storage formats ([`Half`]), the flat parameter and gradient buffers in the compute precision
//! ([`Flat`], [`Bucketed`]) and dynamic loss scaling ([`LossScaler`]).
//!
//! The model's kernels compute in fp32 over fp32 slices. For bf16 / fp16 training the weights
//! and gradients are *stored* in 16 bits (2Φ + 2Φ bytes) beside fp32 master weights; the
//! executor widens one unit's weights at a time into an fp32 copy ([`Flat::read_buf`]), and a
//! unit's backward accumulates its gradient in fp32 before rounding it back once
//! ([`Flat::update_buf`]). So the numerics are those of 16-bit storage with fp32 accumulation
//! (Megatron's bf16 mode), and the memory held is the accounted 2Φ + 2Φ + 12Φ plus one unit's
//! scratch. On a GPU the same rule holds with the 16-bit buffers on the device
//! ([`Flat::DevHalf`]), widened and rounded by the cast kernels (round to nearest even, as
//! `half` does on the host).
use std::ops::Range;

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};
use serde::{Deserialize, Serialize};
use tensor::buf::{Buf, BufMut, BufRef, Dev, HostBuf};
use tensor::cuda::{DevBuf, DevSlice, DevSliceMut, NcclBufMut, Staged};
use tensor::dtype::DType;
use tensor::TensorError;

/// Numeric format of the training state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// fp32 everything: 4Φ weights + 4Φ gradients + 8Φ AdamW moments = 16Φ bytes.
    Fp32,
    /// bf16 weights and gradients, fp32 master weights and moments: 2Φ + 2Φ + 12Φ bytes.
    Bf16,
    /// As bf16 but fp16 storage, with dynamic loss scaling (fp16 has 5 exponent bits, so small
    /// gradients underflow unless the loss is scaled up first).
    Fp16,
}

impl Precision {
    /// The name configs use (`fp32`, `bf16`, `fp16`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    /// The 16-bit storage format, `None` for fp32.
    pub fn half(self) -> Option<Half> {
        match self {
            Precision::Fp32 => None,
            Precision::Bf16 => Some(Half::Bf16),
            Precision::Fp16 => Some(Half::F16),
        }
    }
    /// Bytes per element of the compute weights and of the gradients.
    pub fn compute_bytes(self) -> usize {
        if self.half().is_some() {
            2
        } else {
            4
        }
    }
    /// Bytes per element of the fp32 master copy (0 in fp32, where the weights are the master).
    pub fn master_bytes(self) -> usize {
        if self.half().is_some() {
            4
        } else {
            0
        }
    }
}

/// Elements per chunk of chunked passes over the flat buffers.
pub const CHUNK: usize = 1 << 16;

/// Elements per chunk of chunked passes over 16-bit GPU buffers (a widened chunk is 16 MiB).
pub const DEVICE_CHUNK: usize = 1 << 22;

/// `f(dst chunk, src chunk)` over chunks of [`CHUNK`] elements of two equally long slices:
/// on the thread budget when there is more than one.
fn chunked<D: Send, S: Sync>(dst: &mut [D], src: &[S], f: impl Fn(&mut [D], &[S]) + Sync) {
    use rayon::prelude::*;
    if dst.len() <= CHUNK {
        f(dst, src);
    } else {
        tensor::threads::install(|| {
            dst.par_chunks_mut(CHUNK)
                .zip(src.par_chunks(CHUNK))
                .for_each(|(d, s)| f(d, s))
        });
    }
}

/// `half`'s `bf16::from_f32` without branches, so a loop of it vectorises: a NaN keeps its
/// upper bits with the quiet bit set; otherwise round to nearest even — add one to the upper
/// half when the dropped half is above 0x8000, or exactly 0x8000 with the kept half odd
/// (`x & 0x17fff`: the kept half's lowest bit or any dropped bit below the round bit).
#[inline(always)]
fn bf16_bits_branchless(x: f32) -> u16 {
    let b = x.to_bits();
    let nan = (b & 0x7fff_ffff) > 0x7f80_0000;
    let up = (b & 0x8000 != 0) & (b & 0x1_7fff != 0);
    let rounded = (b >> 16) + up as u32;
    (if nan { (b >> 16) | 0x40 } else { rounded }) as u16
}

/// Where ZeRO-Offload's 16-bit gradients land for the host's AdamW (`executor::offload`):
/// page-locked memory the GPU's copy engine fills, or on the CPU a vector copied into at
/// once — the same bookkeeping either way, so the CPU runs prove which gradients land when.
pub enum Landing {
    Host(Vec<u16>),
    Gpu(Staged<u16>),
}

impl Landing {
    /// The landed bits, once every queued landing has finished.
    pub fn host(&mut self) -> Result<&mut [u16], TensorError> {
        Ok(match self {
            Landing::Host(v) => v,
            Landing::Gpu(s) => s.host()?,
        })
    }

    /// The landed bits when no landing is in flight (after [`Self::host`]).
    pub fn settled(&self) -> Option<&[u16]> {
        match self {
            Landing::Host(v) => Some(v),
            Landing::Gpu(s) => s.settled(),
        }
    }

    /// [`Self::settled`], to write (no call into the driver: from any thread).
    pub fn settled_mut(&mut self) -> Option<&mut [u16]> {
        match self {
            Landing::Host(v) => Some(v),
            Landing::Gpu(s) => s.settled_mut(),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Landing::Host(v) => v.len(),
            Landing::Gpu(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Page-locked bytes held (none for a host vector).
    pub fn pinned_bytes(&self) -> usize {
        match self {
            Landing::Host(_) => 0,
            Landing::Gpu(s) => 2 * s.len(),
        }
    }

    /// A new buffer of the same length and kind.
    pub fn twin(&self) -> Result<Landing, TensorError> {
        Ok(match self {
            Landing::Host(v) => Landing::Host(vec![0; v.len()]),
            Landing::Gpu(s) => Landing::Gpu(Staged::new(s.gpu(), s.len())?),
        })
    }

    /// Whether `other` is a buffer of the same length and kind.
    pub fn is_twin(&self, other: &Landing) -> bool {
        self.len() == other.len()
            && matches!(
                (self, other),
                (Landing::Host(_), Landing::Host(_)) | (Landing::Gpu(_), Landing::Gpu(_))
            )
    }
}

/// A 16-bit storage format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Half {
    Bf16,
    F16,
}

impl Half {
    /// The products' operand format of the same 16 bits (a GPU step's
    /// [`tensor::operands::Operands`]).
    pub fn operands(self) -> tensor::operands::Operands {
        match self {
            Half::Bf16 => tensor::operands::Operands::Bf16,
            Half::F16 => tensor::operands::Operands::F16,
        }
    }

    #[inline]
    pub fn to_f32(self, b: u16) -> f32 {
        match self {
            Half::Bf16 => bf16::from_bits(b).to_f32(),
            Half::F16 => f16::from_bits(b).to_f32(),
        }
    }

    /// Round to nearest even (both `half` conversions do); fp16 overflow becomes ±inf.
    #[inline]
    pub fn from_f32(self, x: f32) -> u16 {
        match self {
            Half::Bf16 => bf16::from_f32(x).to_bits(),
            Half::F16 => f16::from_f32(x).to_bits(),
        }
    }

    /// `src` widened into `dst` (same length; exact). Large slices in chunks on the thread
    /// budget: ZeRO-Offload widens every gradient of a step on the host, and a CPU step in
    /// 16 bits every weight.
    pub fn upcast(self, src: &[u16], dst: &mut [f32]) {
        assert_eq!(
            src.len(),
            dst.len(),
            "upcast of slices of different lengths"
        );
        chunked(dst, src, |d, s| match self {
            // bf16 is fp32's upper half: a shift (a NaN quieted, as `half` does), without
            // branches so that the compiler vectorises it.
            Half::Bf16 => d.iter_mut().zip(s).for_each(|(d, &s)| {
                let quiet = if s & 0x7fff > 0x7f80 { 0x40 } else { 0 };
                *d = f32::from_bits(((s | quiet) as u32) << 16)
            }),
            // `half`'s slice conversion: F16C where the CPU has it, found at run time.
            Half::F16 => bytemuck::cast_slice::<u16, f16>(s).convert_to_f32_slice(d),
        });
    }

    /// `src` rounded to nearest even into `dst` (same length), bit for bit
    /// [`Half::from_f32`]; large slices in chunks on the thread budget.
    pub fn downcast(self, src: &[f32], dst: &mut [u16]) {
        assert_eq!(
            src.len(),
            dst.len(),
            "downcast of slices of different lengths"
        );
        chunked(dst, src, |d, s| match self {
            Half::Bf16 => d
                .iter_mut()
                .zip(s)
                .for_each(|(d, &x)| *d = bf16_bits_branchless(x)),
            Half::F16 => bytemuck::cast_slice_mut::<u16, f16>(d).convert_from_f32_slice(s),
        });
    }

    /// The element type of collectives on this storage.
    pub fn dtype(self) -> DType {
        match self {
            Half::Bf16 => DType::BF16,
            Half::F16 => DType::F16,
        }
    }

    /// `src` widened to fp32 in a new GPU buffer.
    fn widen_dev(self, src: DevSlice<'_, u16>) -> Result<Buf, TensorError> {
        let mut out = src.gpu().alloc::<f32>(src.len())?;
        self.widen_into(src, (&mut out).into())?;
        Ok(Buf::Cuda(out))
    }

    /// `src` widened to fp32 into `dst` on the GPU.
    fn widen_into(
        self,
        src: DevSlice<'_, u16>,
        dst: DevSliceMut<'_, f32>,
    ) -> Result<(), TensorError> {
        match self {
            Half::Bf16 => tensor::cuda::ops::cast_bf16_to_f32(src, dst)?,
            Half::F16 => tensor::cuda::ops::cast_f16_to_f32(src, dst)?,
        }
        Ok(())
    }

    /// `src` rounded into `dst` on the GPU.
    fn narrow_dev(
        self,
        src: DevSlice<'_, f32>,
        dst: DevSliceMut<'_, u16>,
    ) -> Result<(), TensorError> {
        match self {
            Half::Bf16 => tensor::cuda::ops::cast_f32_to_bf16(src, dst)?,
            Half::F16 => tensor::cuda::ops::cast_f32_to_f16(src, dst)?,
        }
        Ok(())
    }
}

/// Checks that `parts` lie inside `r`, in order and apart.
fn check_parts(r: &Range<usize>, parts: &[Range<usize>]) -> Result<(), TensorError> {
    let mut at = r.start;
    for p in parts {
        if p.start < at || p.end < p.start || p.end > r.end {
            return Err(TensorError::Shape(format!(
                "parts {parts:?} of {r:?}: not inside it, in order and apart"
            )));
        }
        at = p.end;
    }
    Ok(())
}

/// A flat buffer of parameters or gradients in the compute precision.
///
/// `Dev` and `DevHalf` live on a GPU. The kernels use them in place through the methods
/// taking or giving [`Buf`] views ([`Flat::view`], [`Flat::read_buf`], [`Flat::write_buf`],
/// [`Flat::update_buf`], [`Flat::try_fill_zero`], [`Flat::try_sq_sum`]); the host-slice
/// methods ([`Flat::read_into`], [`Flat::write`], [`Flat::update`], [`Flat::piece`]) stage
/// through host memory there — a download, the host code, an upload — which is how the
/// data-parallel reductions and ZeRO's gathers of a GPU run over the host transports.
#[derive(Debug)]
pub enum Flat {
    F32(Vec<f32>),
    /// 16-bit bit patterns of `kind`.
    Half {
        kind: Half,
        bits: Vec<u16>,
    },
    /// fp32 on a GPU.
    Dev(Buf),
    /// 16-bit bit patterns of `kind` on a GPU.
    DevHalf {
        kind: Half,
        bits: DevBuf<u16>,
    },
}

impl Flat {
    /// `n` zeros in the compute precision of `precision`.
    pub fn zeros(n: usize, precision: Precision) -> Self {
        match precision.half() {
            None => Flat::F32(vec![0.0; n]),
            Some(kind) => Flat::Half {
                kind,
                bits: vec![0; n],
            },
        }
    }

    /// `values` rounded to the compute precision of `precision`.
    pub fn from_f32(values: Vec<f32>, precision: Precision) -> Self {
        match precision.half() {
            None => Flat::F32(values),
            Some(kind) => {
                let mut bits = vec![0; values.len()];
                kind.downcast(&values, &mut bits);
                Flat::Half { kind, bits }
            }
        }
    }

    pub fn len(&self) -> usize {
        match self {
            Flat::F32(v) => v.len(),
            Flat::Half { bits, .. } => bits.len(),
            Flat::Dev(b) => b.len(),
            Flat::DevHalf { bits, .. } => bits.len(),
        }
    }

    /// The 16-bit format of the storage (`None`: fp32).
    pub fn half(&self) -> Option<Half> {
        match self {
            Flat::F32(_) | Flat::Dev(_) => None,
            Flat::Half { kind, .. } | Flat::DevHalf { kind, .. } => Some(*kind),
        }
    }

    /// `values` rounded to the compute precision of `precision`, on device `dev` (16-bit
    /// values are rounded on the host, then copied).
    pub fn from_f32_on(
        dev: &Dev,
        values: Vec<f32>,
        precision: Precision,
    ) -> Result<Self, TensorError> {
        match (dev, precision.half()) {
            (Dev::Cpu, _) => Ok(Self::from_f32(values, precision)),
            (Dev::Cuda(_), None) => Ok(Flat::Dev(dev.from_vec(values)?)),
            (Dev::Cuda(g), Some(kind)) => {
                let mut bits = vec![0; values.len()];
                kind.downcast(&values, &mut bits);
                Ok(Flat::DevHalf {
                    kind,
                    bits: g.upload(&bits)?,
                })
            }
        }
    }

    /// `n` zeros on device `dev` in the compute precision of `precision`.
    pub fn zeros_on(dev: &Dev, n: usize, precision: Precision) -> Result<Self, TensorError> {
        match (dev, precision.half()) {
            (Dev::Cpu, _) => Ok(Self::zeros(n, precision)),
            (Dev::Cuda(_), None) => Ok(Flat::Dev(dev.zeros(n)?)),
            (Dev::Cuda(g), Some(kind)) => Ok(Flat::DevHalf {
                kind,
                bits: g.zeros(n)?,
            }),
        }
    }

    /// Elements `r` of GPU 16-bit storage as its bits, with their format (`None` for other
    /// storage).
    pub fn dev_bits(&self, r: Range<usize>) -> Option<(Half, tensor::cuda::DevSlice<'_, u16>)> {
        match self {
            Flat::DevHalf { kind, bits } => Some((*kind, bits.slice(r))),
            _ => None,
        }
    }

    /// Elements `r` as a read-only view (fp32 storage only: host or GPU).
    pub fn view(&self, r: Range<usize>) -> Option<BufRef<'_>> {
        match self {
            Flat::F32(v) => Some(BufRef::Host(&v[r])),
            Flat::Dev(b) => Some(b.r().slice(r)),
            Flat::Half { .. } | Flat::DevHalf { .. } => None,
        }
    }

    /// Elements `r` as an fp32 copy on the buffer's device (16-bit storage widened).
    pub fn read_buf(&self, r: Range<usize>) -> Result<Buf, TensorError> {
        match self {
            Flat::F32(_) | Flat::Half { .. } => Ok(Buf::Host(self.read(r)?)),
            Flat::Dev(b) => b.r().slice(r).to_buf(),
            Flat::DevHalf { kind, bits } => kind.widen_dev(bits.slice(r)),
        }
    }

    /// Elements `r` as an fp32 copy on the buffer's device in which, for 16-bit storage on a
    /// GPU, only `parts` (flat ranges inside `r`) are widened: the rest of the copy is left
    /// unwritten, for readers that take those elements' 16-bit bits instead (products through
    /// a registered widening, [`tensor::cuda::widening`]). Other storage: [`Flat::read_buf`].
    pub fn read_buf_parts(
        &self,
        r: Range<usize>,
        parts: &[Range<usize>],
    ) -> Result<Buf, TensorError> {
        let Flat::DevHalf { kind, bits } = self else {
            return self.read_buf(r);
        };
        if kind.operands() != tensor::operands::current() {
            // The products would round the copy's values: widen them all.
            return self.read_buf(r);
        }
        check_parts(&r, parts)?;
        let mut out = bits.gpu().alloc::<f32>(r.len())?;
        for p in parts.iter().filter(|p| !p.is_empty()) {
            let dst = out.slice_mut(p.start - r.start..p.end - r.start);
            kind.widen_into(bits.slice(p.clone()), dst)?;
        }
        Ok(Buf::Cuda(out))
    }

    /// Stores `src` (rounded for 16-bit storage) at `start..`; `src` is on the buffer's device.
    pub fn write_buf(&mut self, start: usize, src: BufRef<'_>) -> Result<(), TensorError> {
        let r = start..start + src.len();
        match self {
            Flat::F32(_) | Flat::Half { .. } => {
                self.write(start, src.as_host("a host parameter buffer")?)
            }
            Flat::Dev(b) => b.m().slice_mut(r).copy_from(src),
            Flat::DevHalf { kind, bits } => match src {
                BufRef::Cuda(s) => kind.narrow_dev(s, bits.slice_mut(r)),
                BufRef::Host(_) => Err(TensorError::Device(
                    "host values written into a GPU parameter buffer".into(),
                )),
            },
        }
    }

    /// Elements `r` of GPU storage as the range an NCCL collective reads and writes, in the
    /// storage's own format (`None` on the host).
    pub fn nccl_view_mut(&mut self, r: Range<usize>) -> Option<NcclBufMut<'_>> {
        match self {
            Flat::Dev(Buf::Cuda(b)) => Some(b.slice_mut(r).into()),
            Flat::DevHalf { kind, bits } => NcclBufMut::half(kind.dtype(), bits.slice_mut(r)).ok(),
            _ => None,
        }
    }

    /// A new GPU buffer of `len` elements in this GPU buffer's format with elements `src`
    /// copied to `at..` (the rest undefined): this rank's block of an in-place gather.
    /// `None` on the host.
    pub fn dev_block(
        &self,
        len: usize,
        src: Range<usize>,
        at: usize,
    ) -> Result<Option<Flat>, TensorError> {
        let dst = at..at + src.len();
        let copy = !src.is_empty();
        Ok(Some(match self {
            Flat::Dev(Buf::Cuda(b)) => {
                let mut out = b.gpu().alloc::<f32>(len)?;
                if copy {
                    out.slice_mut(dst).copy_from(b.slice(src))?;
                }
                Flat::Dev(Buf::Cuda(out))
            }
            Flat::DevHalf { kind, bits } => {
                let mut out = bits.gpu().alloc::<u16>(len)?;
                if copy {
                    out.slice_mut(dst).copy_from(bits.slice(src))?;
                }
                Flat::DevHalf {
                    kind: *kind,
                    bits: out,
                }
            }
            _ => return Ok(None),
        }))
    }

    /// The whole buffer as fp32 on its device: itself when it is fp32, else widened.
    pub fn into_f32_buf(self) -> Result<Buf, TensorError> {
        match self {
            Flat::F32(v) => Ok(Buf::Host(v)),
            Flat::Dev(b) => Ok(b),
            other => other.read_buf(0..other.len()),
        }
    }

    /// Runs `f` on elements `r` as an fp32 view on the buffer's device: in place for fp32
    /// (host or GPU); for 16-bit storage through an fp32 copy rounded back afterwards.
    pub fn update_buf<T, E: From<TensorError>>(
        &mut self,
        r: Range<usize>,
        f: impl FnOnce(BufMut<'_>) -> Result<T, E>,
    ) -> Result<T, E> {
        self.update_buf_in(r, &mut Vec::new(), f)
    }

    /// [`Flat::update_buf`] with host 16-bit storage widened into `widened` (resized to the
    /// range where it differs): a buffer the caller reuses.
    pub fn update_buf_in<T, E: From<TensorError>>(
        &mut self,
        r: Range<usize>,
        widened: &mut Vec<f32>,
        f: impl FnOnce(BufMut<'_>) -> Result<T, E>,
    ) -> Result<T, E> {
        match self {
            Flat::F32(v) => f(BufMut::Host(&mut v[r])),
            Flat::Dev(b) => f(b.m().slice_mut(r)),
            Flat::Half { kind, bits } => {
                if widened.len() != r.len() {
                    *widened = vec![0.0; r.len()];
                }
                let g = &mut widened[..];
                kind.upcast(&bits[r.clone()], g);
                let out = f(BufMut::Host(g))?;
                kind.downcast(g, &mut bits[r]);
                Ok(out)
            }
            Flat::DevHalf { kind, bits } => {
                let mut g = kind.widen_dev(bits.slice(r.clone()))?;
                let out = f(g.m())?;
                let Buf::Cuda(g) = &g else {
                    unreachable!("widened on the GPU")
                };
                kind.narrow_dev(g.as_slice(), bits.slice_mut(r))?;
                Ok(out)
            }
        }
    }

    /// The whole buffer as fp32 on the host (a copy; downloaded from a GPU).
    pub fn download(&self) -> Result<Vec<f32>, TensorError> {
        match self {
            Flat::Dev(b) => b.to_vec(),
            Flat::DevHalf { kind, bits } => {
                let bits = bits.to_host()?;
                let mut out = vec![0.0; bits.len()];
                kind.upcast(&bits, &mut out);
                Ok(out)
            }
            other => other.read(0..other.len()),
        }
    }

    /// Sets every element to zero.
    pub fn try_fill_zero(&mut self) -> Result<(), TensorError> {
        match self {
            Flat::F32(v) => tensor::threads::scale(v, 0.0),
            Flat::Half { bits, .. } => bits.fill(0),
            Flat::Dev(b) => b.m().zero()?,
            Flat::DevHalf { bits, .. } => bits.zero()?,
        }
        Ok(())
    }

    /// Σ x² over elements `r` in f64 (on the buffer's device; 16-bit storage widened a chunk
    /// of [`DEVICE_CHUNK`] at a time).
    pub fn try_sq_sum(&self, r: Range<usize>) -> Result<f64, TensorError> {
        match self {
            Flat::Dev(b) => tensor::ops::sq_sum(b.r().slice(r)),
            Flat::DevHalf { kind, bits } => {
                let mut total = 0.0;
                for s in r.clone().step_by(DEVICE_CHUNK) {
                    let e = (s + DEVICE_CHUNK).min(r.end);
                    total += tensor::ops::sq_sum(kind.widen_dev(bits.slice(s..e))?.r())?;
                }
                Ok(total)
            }
            other => Ok(other.host_sq_sum(r)),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match self {
            Flat::F32(v) => std::mem::size_of_val(v.as_slice()),
            Flat::Half { bits, .. } => std::mem::size_of_val(bits.as_slice()),
            Flat::Dev(b) => b.bytes(),
            Flat::DevHalf { bits, .. } => bits.bytes(),
        }
    }

    /// The fp32 host buffer itself (`None` for 16-bit storage, which is read through a copy,
    /// and for a GPU buffer).
    pub fn as_f32(&self) -> Option<&[f32]> {
        match self {
            Flat::F32(v) => Some(v),
            _ => None,
        }
    }

    /// Elements `r` as fp32 (a copy on the host; downloaded from a GPU).
    pub fn read(&self, r: Range<usize>) -> Result<Vec<f32>, TensorError> {
        let mut out = vec![0.0; r.len()];
        self.read_into(r, &mut out)?;
        Ok(out)
    }

    /// Elements `r` as fp32 into host slice `out` (downloaded from a GPU).
    pub fn read_into(&self, r: Range<usize>, out: &mut [f32]) -> Result<(), TensorError> {
        match self {
            Flat::F32(v) => out.copy_from_slice(&v[r]),
            Flat::Half { kind, bits } => kind.upcast(&bits[r], out),
            Flat::Dev(b) => b.r().slice(r).read_into(out)?,
            Flat::DevHalf { kind, bits } => kind.upcast(&bits.slice(r).to_host()?, out),
        }
        Ok(())
    }

    /// Stores host values `src` (rounded for 16-bit storage) at `start..` (uploaded to a GPU).
    pub fn write(&mut self, start: usize, src: &[f32]) -> Result<(), TensorError> {
        let r = start..start + src.len();
        match self {
            Flat::F32(v) => v[r].copy_from_slice(src),
            Flat::Dev(b) => b.m().slice_mut(r).copy_from_host(src)?,
            Flat::Half { kind, .. } | Flat::DevHalf { kind, .. } => {
                let kind = *kind;
                self.store_rounded(start, src.len(), None, |out| kind.downcast(src, out))?;
            }
        }
        Ok(())
    }

    /// Stores 16-bit values `f` writes into a slice of `n` elements at `start..`: on the host
    /// straight into the bits; on a GPU into `stage` (page-locked, the caller keeps it), which
    /// then goes up on its own stream — the call returns once `f` has run, the copy engine
    /// uploads while the host goes on, and the compute stream's later work sees the values
    /// ([`Staged::upload`]; the stage's previous upload has finished before `f` writes it) —
    /// or without a stage through a vector. An error for fp32 storage.
    pub fn store_rounded(
        &mut self,
        start: usize,
        n: usize,
        stage: Option<&mut Staged<u16>>,
        f: impl FnOnce(&mut [u16]),
    ) -> Result<(), TensorError> {
        let r = start..start + n;
        match (self, stage) {
            (Flat::Half { bits, .. }, _) => f(&mut bits[r]),
            (Flat::DevHalf { bits, .. }, Some(stage)) => {
                let h = stage.host()?;
                if h.len() < n {
                    return Err(TensorError::Shape(format!(
                        "a 16-bit staging buffer of {} elements for a copy of {n}",
                        h.len()
                    )));
                }
                f(&mut h[..n]);
                stage.upload(0..n, bits.slice_mut(r))?;
            }
            (Flat::DevHalf { bits, .. }, None) => {
                let mut h = vec![0u16; n];
                f(&mut h);
                bits.slice_mut(r).copy_from_host(&h)?;
            }
            (Flat::F32(_) | Flat::Dev(_), _) => {
                return Err(TensorError::Shape(
                    "16-bit values stored into fp32 weights".into(),
                ))
            }
        }
        Ok(())
    }

    /// Stores the 16-bit bits held in `landing` at `start..` (uploaded to a GPU: from a
    /// page-locked landing on its stream, ahead of the compute stream's later work).
    pub fn store_landed(&mut self, start: usize, landing: &mut Landing) -> Result<(), TensorError> {
        let r = start..start + landing.len();
        match (self, landing) {
            (Flat::Half { bits, .. }, l) => bits[r].copy_from_slice(l.host()?),
            (Flat::DevHalf { bits, .. }, Landing::Gpu(s)) => {
                s.upload(0..r.len(), bits.slice_mut(r))?
            }
            (Flat::DevHalf { bits, .. }, Landing::Host(h)) => {
                bits.slice_mut(r).copy_from_host(h)?
            }
            (Flat::F32(_) | Flat::Dev(_), _) => {
                return Err(TensorError::Shape(
                    "16-bit values stored into fp32 weights".into(),
                ))
            }
        }
        Ok(())
    }

    /// Runs `f` on elements `r` as fp32 host values: in place for fp32 on the host; for
    /// 16-bit storage or a GPU buffer through an fp32 host copy that is stored back afterwards
    /// (one rounding per call).
    pub fn update<T>(
        &mut self,
        r: Range<usize>,
        f: impl FnOnce(&mut [f32]) -> T,
    ) -> Result<T, TensorError> {
        if let Flat::F32(v) = self {
            return Ok(f(&mut v[r]));
        }
        let mut g = self.read(r.clone())?;
        let out = f(&mut g);
        self.write(r.start, &g)?;
        Ok(out)
    }

    /// Σ x² over host elements `r` in f64, as chunk partials on the thread budget added in
    /// chunk order: bit-reproducible run to run and whatever the thread count.
    fn host_sq_sum(&self, r: Range<usize>) -> f64 {
        let base = r.start;
        match self {
            Flat::F32(v) => tensor::threads::sum_chunks(r.len(), CHUNK, |c| {
                model::optim::sq_sum(&v[base + c.start..base + c.end])
            }),
            Flat::Half { kind, bits } => tensor::threads::sum_chunks(r.len(), CHUNK, |c| {
                bits[base + c.start..base + c.end]
                    .iter()
                    .map(|&g| {
                        let g = kind.to_f32(g) as f64;
                        g * g
                    })
                    .sum::<f64>()
            }),
            Flat::Dev(_) | Flat::DevHalf { .. } => unreachable!("try_sq_sum sums on the GPU"),
        }
    }

    /// Elements `r` as a piece to send in the buffer's own precision (16-bit: half the bytes),
    /// in host memory for the host transports: a vector on the CPU, from a GPU downloaded into
    /// page-locked scratch ([`HostBuf`]).
    pub fn piece(&self, r: Range<usize>) -> Result<Piece, TensorError> {
        let half = |kind: Half, bits: &[u16]| match kind {
            Half::Bf16 => Piece::Bf16(HostBuf::Vec(bytemuck::cast_slice(bits).to_vec())),
            Half::F16 => Piece::F16(HostBuf::Vec(bytemuck::cast_slice(bits).to_vec())),
        };
        Ok(match self {
            Flat::F32(v) => Piece::F32(HostBuf::Vec(v[r].to_vec())),
            Flat::Half { kind, bits } => half(*kind, &bits[r]),
            Flat::Dev(b) => Piece::F32(b.r().slice(r).to_host_buf()?),
            Flat::DevHalf { kind, bits } => {
                let mut out = Piece::staging(Some(*kind), &Dev::Cuda(bits.gpu().clone()), r.len())?;
                bits.slice(r).read_into(out.bits_mut().expect("16-bit"))?;
                out
            }
        })
    }

    /// Stores `piece` (values in this buffer's own precision, as [`Flat::piece`] gives them)
    /// at `start..`, bit for bit: uploaded to a GPU. An error where the precisions differ.
    pub fn write_piece(&mut self, start: usize, piece: &Piece) -> Result<(), TensorError> {
        let r = start..start + piece.len();
        match (self, piece) {
            (Flat::F32(v), Piece::F32(p)) => v[r].copy_from_slice(p),
            (Flat::Dev(b), Piece::F32(p)) => b.m().slice_mut(r).copy_from_host(p)?,
            (Flat::Half { kind, bits }, p) if p.half() == Some(*kind) => {
                bits[r].copy_from_slice(p.bits().expect("16-bit"))
            }
            (Flat::DevHalf { kind, bits }, p) if p.half() == Some(*kind) => bits
                .slice_mut(r)
                .copy_from_host(p.bits().expect("16-bit"))?,
            (flat, p) => {
                return Err(TensorError::Config(format!(
                    "a piece of {:?} values written into {:?} storage",
                    p.half(),
                    flat.half()
                )))
            }
        }
        Ok(())
    }

    /// This buffer on device `dev`: itself on the CPU, uploaded (16-bit storage as its bits)
    /// to a GPU.
    pub fn to_dev(self, dev: &Dev) -> Result<Self, TensorError> {
        let Dev::Cuda(g) = dev else {
            return Ok(self);
        };
        Ok(match self {
            Flat::F32(v) => Flat::Dev(dev.from_vec(v)?),
            Flat::Half { kind, bits } => Flat::DevHalf {
                kind,
                bits: g.upload(&bits)?,
            },
            on_gpu => on_gpu,
        })
    }
}

/// Values on the wire in the buffer's own precision, in host memory for the host transports
/// ([`HostBuf`]: a vector on the CPU, page-locked scratch for a GPU's).
pub enum Piece {
    F32(HostBuf<f32>),
    Bf16(HostBuf<bf16>),
    F16(HostBuf<f16>),
}

impl Piece {
    /// `n` elements of host memory for staging `dev`'s values of the format `half` (fp32
    /// where `None`), to be written whole ([`Dev::host_buf`]).
    pub fn staging(half: Option<Half>, dev: &Dev, n: usize) -> Result<Piece, TensorError> {
        Ok(match half {
            None => Piece::F32(dev.host_buf(n)?),
            Some(Half::Bf16) => Piece::Bf16(dev.host_buf(n)?),
            Some(Half::F16) => Piece::F16(dev.host_buf(n)?),
        })
    }

    pub fn len(&self) -> usize {
        match self {
            Piece::F32(v) => v.len(),
            Piece::Bf16(v) => v.len(),
            Piece::F16(v) => v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The 16-bit format (`None`: fp32).
    pub fn half(&self) -> Option<Half> {
        match self {
            Piece::F32(_) => None,
            Piece::Bf16(_) => Some(Half::Bf16),
            Piece::F16(_) => Some(Half::F16),
        }
    }

    /// Bytes per element.
    pub fn elem_bytes(&self) -> usize {
        match self {
            Piece::F32(_) => 4,
            _ => 2,
        }
    }

    /// The bit patterns of 16-bit values (`None` for fp32).
    pub fn bits(&self) -> Option<&[u16]> {
        match self {
            Piece::F32(_) => None,
            Piece::Bf16(v) => Some(bytemuck::cast_slice(v)),
            Piece::F16(v) => Some(bytemuck::cast_slice(v)),
        }
    }

    fn bits_mut(&mut self) -> Option<&mut [u16]> {
        match self {
            Piece::F32(_) => None,
            Piece::Bf16(v) => Some(bytemuck::cast_slice_mut(v)),
            Piece::F16(v) => Some(bytemuck::cast_slice_mut(v)),
        }
    }

    /// As fp32 on `dev` (16-bit values widen exactly): widened on the host for the CPU; for
    /// a GPU uploaded in their own precision (half the bytes) and widened there.
    pub fn into_f32_buf(self, dev: &Dev) -> Result<Buf, TensorError> {
        let (Some(kind), Some(bits)) = (self.half(), self.bits()) else {
            let Piece::F32(v) = self else {
                unreachable!("a piece without bits is fp32")
            };
            return dev.from_host(v);
        };
        match dev {
            Dev::Cpu => {
                let mut out = vec![0.0; bits.len()];
                kind.upcast(bits, &mut out);
                Ok(Buf::Host(out))
            }
            Dev::Cuda(g) => kind.widen_dev(g.upload(bits)?.as_slice()),
        }
    }
}

/// A flat buffer kept as one allocation per bucket (contiguous ranges that tile `0..len`), so
/// a bucket can be handed to an asynchronous collective by value and put back afterwards —
/// an in-place all-reduce of a bucket of the gradient buffer, with no copy. A single bucket
/// covering everything is an ordinary flat buffer (a ZeRO-2/3 gradient shard).
#[derive(Debug)]
pub struct Bucketed {
    /// Flat range of each bucket (any order; together they tile `0..len`).
    ranges: Vec<Range<usize>>,
    /// Bucket indices by increasing start.
    order: Vec<usize>,
    /// `None` while the bucket is lent out.
    bufs: Vec<Option<Flat>>,
    elem_bytes: usize,
}

impl Bucketed {
    /// Zeros cut into `ranges`, which must tile `0..n` for some `n`.
    pub fn zeros(ranges: Vec<Range<usize>>, precision: Precision) -> Self {
        Self::zeros_on(&Dev::Cpu, ranges, precision).expect("host zeros cannot fail")
    }

    /// Bytes of the whole buffer (lent buckets included).
    pub fn bytes(&self) -> usize {
        self.ranges.iter().map(|r| r.len()).sum::<usize>() * self.elem_bytes
    }

    fn buf(&self, b: usize) -> &Flat {
        self.bufs[b].as_ref().expect("bucket is not lent out")
    }

    fn buf_mut(&mut self, b: usize) -> &mut Flat {
        self.bufs[b].as_mut().expect("bucket is not lent out")
    }

    /// The buckets' pieces of flat range `r`, in address order: (bucket, range inside it).
    fn pieces(&self, r: Range<usize>) -> Vec<(usize, Range<usize>)> {
        self.order
            .iter()
            .filter_map(|&b| {
                let br = &self.ranges[b];
                let (s, e) = (r.start.max(br.start), r.end.min(br.end));
                (s < e).then(|| (b, s - br.start..e - br.start))
            })
            .collect()
    }

    /// Sets every bucket to zero (on its device).
    pub fn fill_zero(&mut self) -> Result<(), TensorError> {
        for b in &mut self.bufs {
            b.as_mut()
                .expect("bucket is not lent out")
                .try_fill_zero()?;
        }
        Ok(())
    }

    /// Zeros cut into `ranges` (as [`Bucketed::zeros`]) on device `dev`.
    pub fn zeros_on(
        dev: &Dev,
        ranges: Vec<Range<usize>>,
        precision: Precision,
    ) -> Result<Self, TensorError> {
        let mut order: Vec<usize> = (0..ranges.len()).collect();
        order.sort_by_key(|&b| ranges[b].start);
        let mut next = 0;
        for &b in &order {
            assert_eq!(ranges[b].start, next, "buckets must tile the buffer");
            next = ranges[b].end;
        }
        // Each bucket made on its device directly (no host copy of a GPU's gradients).
        let bufs = ranges
            .iter()
            .map(|r| Flat::zeros_on(dev, r.len(), precision).map(Some))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            ranges,
            order,
            bufs,
            elem_bytes: precision.compute_bytes(),
        })
    }

    /// [`Flat::update_buf`] of range `r`, which must lie inside bucket `b`.
    pub fn update_buf<T, E: From<TensorError>>(
        &mut self,
        b: usize,
        r: Range<usize>,
        f: impl FnOnce(BufMut<'_>) -> Result<T, E>,
    ) -> Result<T, E> {
        self.update_buf_in(b, r, &mut Vec::new(), f)
    }

    /// [`Flat::update_buf_in`] on flat range `r` of bucket `b`.
    pub fn update_buf_in<T, E: From<TensorError>>(
        &mut self,
        b: usize,
        r: Range<usize>,
        widened: &mut Vec<f32>,
        f: impl FnOnce(BufMut<'_>) -> Result<T, E>,
    ) -> Result<T, E> {
        let start = self.ranges[b].start;
        debug_assert!(self.ranges[b].start <= r.start && r.end <= self.ranges[b].end);
        self.buf_mut(b)
            .update_buf_in(r.start - start..r.end - start, widened, f)
    }

    /// Runs `f(flat offset, piece)` on the fp32 pieces of flat range `r` as views on their
    /// device, in address order (`None` for 16-bit storage).
    pub fn f32_views_mut(
        &mut self,
        r: Range<usize>,
        mut f: impl FnMut(usize, BufMut<'_>),
    ) -> Option<()> {
        for (b, p) in self.pieces(r) {
            let start = self.ranges[b].start + p.start;
            match self.buf_mut(b) {
                Flat::F32(v) => f(start, BufMut::Host(&mut v[p])),
                Flat::Dev(d) => f(start, d.m().slice_mut(p)),
                Flat::Half { .. } | Flat::DevHalf { .. } => return None,
            }
        }
        Some(())
    }

    /// Σ x² over flat range `r` on the buffers' device (bucket by bucket).
    pub fn try_sq_sum(&self, r: Range<usize>) -> Result<f64, TensorError> {
        let mut total = 0.0;
        for (b, p) in self.pieces(r) {
            total += self.buf(b).try_sq_sum(p)?;
        }
        Ok(total)
    }

    /// The whole buffer as fp32 on the host (downloaded from a GPU).
    pub fn download(&self) -> Result<Vec<f32>, TensorError> {
        let total: usize = self.ranges.iter().map(|r| r.len()).sum();
        let mut out = vec![0.0; total];
        for &b in &self.order {
            let r = self.ranges[b].clone();
            out[r].copy_from_slice(&self.buf(b).download()?);
        }
        Ok(out)
    }

    /// [`Flat::update`] of range `r`, which must lie inside bucket `b`.
    pub fn update<T>(
        &mut self,
        b: usize,
        r: Range<usize>,
        f: impl FnOnce(&mut [f32]) -> T,
    ) -> Result<T, TensorError> {
        let start = self.ranges[b].start;
        debug_assert!(self.ranges[b].start <= r.start && r.end <= self.ranges[b].end);
        self.buf_mut(b).update(r.start - start..r.end - start, f)
    }

    /// [`Flat::read_buf`] of range `r`, which must lie inside bucket `b`.
    pub fn read_buf(&self, b: usize, r: Range<usize>) -> Result<Buf, TensorError> {
        let start = self.ranges[b].start;
        self.buf(b).read_buf(r.start - start..r.end - start)
    }

    /// [`Flat::write_buf`] at flat offset `start` (inside bucket `b`).
    pub fn write_buf(
        &mut self,
        b: usize,
        start: usize,
        src: BufRef<'_>,
    ) -> Result<(), TensorError> {
        let base = self.ranges[b].start;
        self.buf_mut(b).write_buf(start - base, src)
    }

    /// Lends bucket `b` out (e.g. to a collective).
    pub fn take(&mut self, b: usize) -> Option<Flat> {
        self.bufs[b].take()
    }

    /// Returns bucket `b`.
    pub fn put(&mut self, b: usize, buf: Flat) {
        debug_assert_eq!(buf.len(), self.ranges[b].len());
        self.bufs[b] = Some(buf);
    }

    /// Whether bucket `b` is at home.
    pub fn has(&self, b: usize) -> bool {
        self.bufs[b].is_some()
    }

    /// Elements `r` of bucket `b` as fp32 (a host copy).
    pub fn read(&self, b: usize, r: Range<usize>) -> Result<Vec<f32>, TensorError> {
        let start = self.ranges[b].start;
        self.buf(b).read(r.start - start..r.end - start)
    }

    /// Stores host values `src` at flat offset `start` (inside bucket `b`).
    pub fn write(&mut self, b: usize, start: usize, src: &[f32]) -> Result<(), TensorError> {
        let base = self.ranges[b].start;
        self.buf_mut(b).write(start - base, src)
    }

    /// Flat range `r` as fp32 into host slice `out`.
    pub fn read_into(&self, r: Range<usize>, out: &mut [f32]) -> Result<(), TensorError> {
        let base = r.start;
        for (b, p) in self.pieces(r) {
            let s = self.ranges[b].start + p.start - base;
            self.buf(b).read_into(p.clone(), &mut out[s..s + p.len()])?;
        }
        Ok(())
    }

    /// Lands flat range `r` of 16-bit gradients, as their bits, in `landing` at element
    /// `at + (i - r.start)` for flat index `i`: from a GPU a download queued behind the
    /// compute stream's work while it goes on ([`Staged::download`]), on the host a copy.
    pub fn land(
        &self,
        r: Range<usize>,
        landing: &mut Landing,
        at: usize,
    ) -> Result<(), TensorError> {
        let base = r.start;
        for (b, p) in self.pieces(r) {
            let s = at + self.ranges[b].start + p.start - base;
            match (self.buf(b), &mut *landing) {
                (Flat::DevHalf { bits, .. }, Landing::Gpu(l)) => l.download(s, bits.slice(p))?,
                (Flat::Half { bits, .. }, Landing::Host(l)) => {
                    l[s..s + p.len()].copy_from_slice(&bits[p])
                }
                _ => {
                    return Err(TensorError::Device(
                        "16-bit gradients land where their weights live: from a GPU in \
                         page-locked memory, on the host in a vector"
                            .into(),
                    ))
                }
            }
        }
        Ok(())
    }

    /// Runs `f(flat offset, piece)` on the fp32 pieces of flat range `r`, in address order
    /// (`None` for 16-bit storage).
    pub fn f32_pieces_mut(
        &mut self,
        r: Range<usize>,
        mut f: impl FnMut(usize, &mut [f32]),
    ) -> Option<()> {
        for (b, p) in self.pieces(r) {
            let start = self.ranges[b].start + p.start;
            match self.buf_mut(b) {
                Flat::F32(v) => f(start, &mut v[p]),
                _ => return None,
            }
        }
        Some(())
    }

    /// The pieces of flat range `r` as the bit patterns of GPU 16-bit buckets, each with its
    /// flat start (in address order); `None` for other storage.
    pub fn dev_half_pieces(
        &self,
        r: Range<usize>,
    ) -> Option<Vec<(usize, tensor::cuda::DevSlice<'_, u16>)>> {
        let mut out = Vec::new();
        for (b, p) in self.pieces(r) {
            let start = self.ranges[b].start + p.start;
            match self.buf(b) {
                Flat::DevHalf { bits, .. } => out.push((start, bits.slice(p))),
                _ => return None,
            }
        }
        Some(out)
    }

    /// The pieces of flat range `r` as the bit patterns of host 16-bit buckets, each with
    /// its flat start (in address order); `None` for other storage.
    pub fn half_pieces(&self, r: Range<usize>) -> Option<Vec<(usize, &[u16])>> {
        let mut out = Vec::new();
        for (b, p) in self.pieces(r) {
            let start = self.ranges[b].start + p.start;
            match self.buf(b) {
                Flat::Half { bits, .. } => out.push((start, &bits[p])),
                _ => return None,
            }
        }
        Some(out)
    }

    /// Whether the buffers hold fp32.
    pub fn is_f32(&self) -> bool {
        self.elem_bytes == 4
    }
}

/// Dynamic loss scaling (Micikevicius et al., 2018): multiply the loss by `scale` so small fp16
/// gradients do not underflow; on overflow (a non-finite gradient) skip the step and halve the
/// scale; after `growth_interval` clean steps double it. Fixed at 1 for fp32 and bf16.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct LossScaler {
    pub scale: f64,
    pub good_steps: u64,
    pub growth_interval: u64,
    /// Fixed at 1 (no scaling) for fp32 and bf16, whose exponent range matches fp32.
    pub dynamic: bool,
}

impl LossScaler {
    pub fn new(precision: Precision, initial: f64) -> Self {
        let dynamic = precision == Precision::Fp16;
        Self {
            scale: if dynamic { initial } else { 1.0 },
            good_steps: 0,
            growth_interval: 200,
            dynamic,
        }
    }

    /// Records whether the step's gradients were finite; returns whether to apply the step.
    pub fn update(&mut self, finite: bool) -> bool {
        if !self.dynamic {
            return finite;
        }
        if finite {
            self.good_steps += 1;
            if self.good_steps.is_multiple_of(self.growth_interval) {
                self.scale *= 2.0;
            }
        } else {
            self.scale = (self.scale / 2.0).max(1.0);
            self.good_steps = 0;
        }
        finite
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parts outside the range, out of order or overlapping are refused.
    #[test]
    #[allow(clippy::single_range_in_vec_init)] // one-part lists are the point
    fn parts_lie_inside_in_order_and_apart() {
        let r = 10..50;
        assert!(check_parts(&r, &[10..12, 20..30, 30..30]).is_ok());
        assert!(check_parts(&r, &[5..12]).is_err(), "before the range");
        assert!(check_parts(&r, &[40..51]).is_err(), "past it");
        assert!(check_parts(&r, &[20..30, 10..12]).is_err(), "out of order");
        assert!(check_parts(&r, &[10..20, 15..25]).is_err(), "overlapping");
    }

    #[test]
    fn half_conversions() {
        assert_eq!(Half::Bf16.to_f32(Half::Bf16.from_f32(1.0)), 1.0);
        // bf16 keeps 8 significant bits: 1 + 2^-9 rounds to 1.
        assert_eq!(
            Half::Bf16.to_f32(Half::Bf16.from_f32(1.0 + 1.0 / 512.0)),
            1.0
        );
        assert!(Half::F16.to_f32(Half::F16.from_f32(1e6)).is_infinite());
    }

    /// The slice conversions (vectorised, chunked on the thread budget) give the bits of the
    /// element conversions `half` defines, over a sweep of every sign, exponent and a spread
    /// of mantissas (rounding ties, NaN payloads, infinities, subnormals included), at a
    /// length served on one thread and one cut into chunks.
    #[test]
    fn slice_casts_equal_the_element_conversions() {
        let mut x: Vec<f32> = (0..1u64 << 32)
            .step_by(1021)
            .map(|b| f32::from_bits(b as u32))
            .collect();
        for tie in [
            0x3f80_8000u32,
            0x3f81_8000,
            0x7f7f_8000,
            0x7f7f_ffff,
            0x0000_8000,
        ] {
            for sign in [0, 0x8000_0000] {
                x.push(f32::from_bits(tie | sign));
            }
        }
        x.extend([
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -0.0,
            f32::MIN_POSITIVE,
        ]);
        assert!(x.len() > 2 * CHUNK);
        for kind in [Half::Bf16, Half::F16] {
            for n in [1000, x.len()] {
                let src = &x[..n];
                let mut bits = vec![0u16; n];
                kind.downcast(src, &mut bits);
                for (i, (&b, &v)) in bits.iter().zip(src).enumerate() {
                    assert_eq!(b, kind.from_f32(v), "{kind:?} {i}: {:#x}", v.to_bits());
                }
                let all: Vec<u16> = (0..n).map(|i| (i * 65_537 / n) as u16).collect();
                let mut wide = vec![0f32; n];
                kind.upcast(&all, &mut wide);
                for (&w, &b) in wide.iter().zip(&all) {
                    assert_eq!(w.to_bits(), kind.to_f32(b).to_bits(), "{kind:?} {b:#x}");
                }
            }
        }
    }

    #[test]
    fn loss_scaler_backs_off_and_grows() {
        let mut s = LossScaler::new(Precision::Fp16, 1024.0);
        assert!(!s.update(false));
        assert_eq!(s.scale, 512.0);
        for _ in 0..200 {
            assert!(s.update(true));
        }
        assert_eq!(s.scale, 1024.0);
        let mut b = LossScaler::new(Precision::Bf16, 1024.0);
        assert_eq!(b.scale, 1.0);
        b.update(true);
        assert_eq!(b.scale, 1.0);
    }

    #[test]
    fn half_rounds_once_per_update_and_widens_exactly() {
        for p in [Precision::Bf16, Precision::Fp16] {
            let mut f = Flat::from_f32(vec![1.0, 2.0, 3.0], p);
            assert_eq!(f.bytes(), 6);
            // 1 + 2^-12 is representable in neither format (8 and 11 significant bits).
            f.update(0..1, |g| g[0] += 1.0 / 4096.0).unwrap();
            assert_eq!(f.read(0..3).unwrap(), vec![1.0, 2.0, 3.0], "{p:?}");
            f.update(0..1, |g| g[0] += 1.0 / 128.0).unwrap();
            assert_eq!(f.read(0..1).unwrap(), vec![1.0 + 1.0 / 128.0]);
            let piece = f.piece(1..3).unwrap();
            assert_eq!((piece.half(), piece.elem_bytes()), (p.half(), 2));
            // Written back bit for bit, elsewhere in the buffer.
            f.write_piece(0, &piece).unwrap();
            assert_eq!(f.read(0..3).unwrap(), vec![2.0, 3.0, 3.0], "{p:?}");
            assert_eq!(
                piece.into_f32_buf(&Dev::Cpu).unwrap().into_vec().unwrap(),
                vec![2.0, 3.0]
            );
            let other = Flat::zeros(2, Precision::Fp32).piece(0..2).unwrap();
            assert!(f.write_piece(0, &other).is_err(), "precisions differ");
            assert_eq!(f.try_sq_sum(1..3).unwrap(), 18.0);
        }
        let mut g = Flat::zeros(2, Precision::Fp32);
        g.write(0, &[0.1, 0.2]).unwrap();
        assert_eq!(g.as_f32(), Some(&[0.1f32, 0.2][..]));
    }

    #[test]
    fn bucketed_pieces_follow_addresses_whatever_the_bucket_order() {
        // Buckets in reverse address order, as gradient buckets are planned.
        let mut b = Bucketed::zeros(vec![6..10, 2..6, 0..2], Precision::Fp32);
        assert_eq!(b.bytes(), 40);
        b.update(1, 3..5, |g| g.copy_from_slice(&[3.0, 4.0]))
            .unwrap();
        b.update(0, 6..8, |g| g.copy_from_slice(&[6.0, 7.0]))
            .unwrap();
        let mut out = vec![0.0; 6];
        b.read_into(2..8, &mut out).unwrap();
        assert_eq!(out, vec![0.0, 3.0, 4.0, 0.0, 6.0, 7.0]);
        assert_eq!(b.try_sq_sum(0..10).unwrap(), 9.0 + 16.0 + 36.0 + 49.0);
        let lent = b.take(1).unwrap();
        assert!(!b.has(1));
        b.put(1, lent);
        let mut seen = Vec::new();
        b.f32_pieces_mut(1..7, |s, p| seen.push((s, p.len())))
            .unwrap();
        assert_eq!(seen, vec![(1, 1), (2, 4), (6, 1)]);
    }
}
