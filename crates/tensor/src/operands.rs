//! The operand format of matrix products on a GPU: fp32 (the parity path, no TF32), or
//! bf16 / fp16 for the tensor cores, with fp32 accumulation and fp32 results either way; and
//! the operands prepared in it once for several products ([`Operand`], [`Kept`]).
//!
//! A bf16 or fp16 run on a GPU feeds its products 16-bit operands, as PyTorch's autocast and
//! Megatron's bf16 mode do: each product rounds `A` and `B` to the format (round to nearest
//! even; the weights already are, being stored in it) and accumulates in fp32, so a product
//! of depth `k` carries a relative error of about 2⁻⁸ per operand (bf16's 8 significant bits)
//! instead of fp32's 2⁻²⁴. Attention in a bf16 or fp16 step runs the tensor-core
//! FlashAttention kernels (Q, K, V, P, dO and dS rounded to the format; softmax and sums in
//! fp32) where the head size allows ([`crate::ops::attention_forward`]). The CPU kernels
//! compute every product in fp32 whatever the format here: they are the reference, and their
//! bf16 runs keep 16-bit storage with fp32 compute ([`Operands`] is ignored on host buffers).
//!
//! The format is the calling thread's, set for the duration of a step by the executor
//! ([`Scope`]) and carried into the kernel thread pool by [`crate::threads::install`], so the
//! model's code takes no extra argument. Every thread starts at fp32.
//!
//! A product rounds a plain fp32 operand itself, every time. An activation that several
//! products read (a layer's input: the q, k and v projections in the forward, their three
//! weight gradients in the backward; an output gradient: its input gradient and its weight
//! gradient) is rounded once instead, as an [`Operand`]; a deferred weight gradient keeps it
//! as a [`Kept`] — on a GPU in a 16-bit format only the rounded copy, half the bytes of the
//! activation. The rounding is the same function of the same values, so every product's
//! result is unchanged to the bit; on the CPU (and in fp32) an operand is the values themselves.

use crate::buf::{Buf, BufRef};
use crate::cuda::{DevBuf, DevSlice};
use crate::TensorError;
use std::cell::Cell;
use std::sync::Arc;

/// Format of a GPU product's operands.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Operands {
    /// fp32 operands, fp32 accumulation (CUDA cores; TF32 off): equal to the CPU within
    /// fp32 reassociation.
    #[default]
    F32,
    /// bf16 operands on the tensor cores, fp32 accumulation.
    Bf16,
    /// fp16 operands on the tensor cores, fp32 accumulation.
    F16,
}

thread_local! {
    static CURRENT: Cell<Operands> = const { Cell::new(Operands::F32) };
}

/// The calling thread's operand format.
pub fn current() -> Operands {
    CURRENT.with(|c| c.get())
}

/// Sets the calling thread's operand format until dropped, then restores the previous one.
#[must_use = "the format holds only while the scope lives"]
pub struct Scope {
    previous: Operands,
}

impl Scope {
    pub fn enter(format: Operands) -> Scope {
        Scope {
            previous: CURRENT.with(|c| c.replace(format)),
        }
    }
}

impl Drop for Scope {
    fn drop(&mut self) {
        CURRENT.with(|c| c.set(self.previous));
    }
}

/// A bf16 or fp16 copy of an fp32 operand on a GPU, rounded to nearest even, and its format.
#[derive(Debug)]
pub struct Rounded {
    bits: DevBuf<u16>,
    format: Operands,
}

impl Rounded {
    fn new(x: DevSlice<'_, f32>, format: Operands) -> Result<Rounded, TensorError> {
        Ok(Rounded {
            bits: crate::cuda::ops::rounded_copy(x, format)?,
            format,
        })
    }

    /// Bits a kernel rounded to `format` as it wrote them ([`crate::prepared`]).
    pub(crate) fn from_bits(bits: DevBuf<u16>, format: Operands) -> Rounded {
        Rounded { bits, format }
    }

    /// The 16-bit values.
    pub fn bits(&self) -> DevSlice<'_, u16> {
        self.bits.as_slice()
    }

    /// The format they were rounded to.
    pub fn format(&self) -> Operands {
        self.format
    }
}

/// A product's operand as the products of the calling thread's format read it: the fp32
/// values (host buffers; GPU products in fp32; or rounded by each product), or their 16-bit
/// copy made once for several products ([`Operand::new`]). A plain [`BufRef`] converts into
/// the first kind.
#[derive(Clone)]
pub enum Operand<'a> {
    Values(BufRef<'a>),
    Rounded(Arc<Rounded>),
}

impl<'a> Operand<'a> {
    /// `x` prepared for the products of the calling thread's format ([`current`]): fp32
    /// values on a GPU in bf16 or fp16 rounded now, once; otherwise `x` as it is (values
    /// themselves, no copy; or an operand already prepared).
    pub fn new(x: impl Into<Operand<'a>>) -> Result<Operand<'a>, TensorError> {
        let x: Operand<'a> = x.into();
        Ok(match (x, current()) {
            (Operand::Values(BufRef::Cuda(d)), f @ (Operands::Bf16 | Operands::F16)) => {
                Operand::Rounded(Arc::new(Rounded::new(d, f)?))
            }
            (x, _) => x,
        })
    }

    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Operand::Values(x) => x.len(),
            Operand::Rounded(r) => r.bits.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The device it is on.
    pub fn dev(&self) -> crate::buf::Dev {
        match self {
            Operand::Values(x) => x.dev(),
            Operand::Rounded(r) => crate::buf::Dev::Cuda(r.bits.gpu().clone()),
        }
    }
}

impl<'a> From<BufRef<'a>> for Operand<'a> {
    fn from(x: BufRef<'a>) -> Operand<'a> {
        Operand::Values(x)
    }
}

impl<'a> From<&'a Buf> for Operand<'a> {
    fn from(x: &'a Buf) -> Operand<'a> {
        Operand::Values(x.r())
    }
}

impl<'a> From<&'a [f32]> for Operand<'a> {
    fn from(x: &'a [f32]) -> Operand<'a> {
        Operand::Values(BufRef::Host(x))
    }
}

impl<'a> From<&'a Vec<f32>> for Operand<'a> {
    fn from(x: &'a Vec<f32>) -> Operand<'a> {
        Operand::Values(BufRef::Host(x))
    }
}

/// An operand kept for a later product (a deferred weight gradient): the activation itself,
/// or — where [`Operand::new`] rounds — only its rounded copy.
#[derive(Clone, Debug)]
pub enum Kept {
    Values(Arc<Buf>),
    Rounded(Arc<Rounded>),
}

impl Kept {
    /// `x` prepared as [`Operand::new`] prepares it, owned.
    pub fn new(x: Arc<Buf>) -> Result<Kept, TensorError> {
        Ok(match Operand::new(x.r())? {
            Operand::Rounded(r) => Kept::Rounded(r),
            Operand::Values(_) => Kept::Values(x),
        })
    }

    /// The operand for a product now.
    pub fn r(&self) -> Operand<'_> {
        match self {
            Kept::Values(x) => Operand::Values(x.r()),
            Kept::Rounded(r) => Operand::Rounded(r.clone()),
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            Kept::Values(x) => x.len(),
            Kept::Rounded(r) => r.bits.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes it keeps alive.
    pub fn bytes(&self) -> usize {
        match self {
            Kept::Values(x) => x.bytes(),
            Kept::Rounded(r) => r.bits.bytes(),
        }
    }

    /// The values, where it keeps them (not only a rounded copy): for a layer that reads its
    /// input itself as well as through products (a mixture of experts' router and dispatch).
    pub fn values(&self) -> Option<&Arc<Buf>> {
        match self {
            Kept::Values(x) => Some(x),
            Kept::Rounded(_) => None,
        }
    }

    /// The address of what it keeps, for counting an operand shared by several tasks once.
    pub fn id(&self) -> *const () {
        match self {
            Kept::Values(x) => Arc::as_ptr(x).cast(),
            Kept::Rounded(r) => Arc::as_ptr(r).cast(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scopes_nest_and_restore() {
        assert_eq!(current(), Operands::F32);
        {
            let _a = Scope::enter(Operands::Bf16);
            assert_eq!(current(), Operands::Bf16);
            {
                let _b = Scope::enter(Operands::F16);
                assert_eq!(current(), Operands::F16);
            }
            assert_eq!(current(), Operands::Bf16);
            // Carried onto the pool's worker threads.
            let seen = crate::threads::install(current);
            assert_eq!(seen, Operands::Bf16);
        }
        assert_eq!(current(), Operands::F32);
        let other = std::thread::spawn(current).join().unwrap();
        assert_eq!(other, Operands::F32, "every thread starts at fp32");
    }

    /// On the host an operand is the values themselves in every format: no copy, the same
    /// buffer kept.
    #[test]
    fn host_operands_are_the_values() {
        for format in [Operands::F32, Operands::Bf16, Operands::F16] {
            let _s = Scope::enter(format);
            let x = Arc::new(Buf::Host(vec![1.0, 2.5, -3.0]));
            match Operand::new(x.r()).unwrap() {
                Operand::Values(BufRef::Host(v)) => {
                    assert!(std::ptr::eq(v, x.as_host("test").unwrap()))
                }
                _ => panic!("{format:?}: a host operand must be its values"),
            }
            let k = Kept::new(x.clone()).unwrap();
            assert!(matches!(&k, Kept::Values(v) if Arc::ptr_eq(v, &x)));
            assert_eq!((k.len(), k.bytes()), (3, 12));
            assert_eq!(k.id(), Arc::as_ptr(&x).cast());
        }
    }
}
