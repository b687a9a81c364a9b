//! The operand format of matrix products on a GPU: fp32 (the parity path, no TF32), or
//! bf16 / fp16 for the tensor cores, with fp32 accumulation and fp32 results either way.
//!
//! A bf16 or fp16 run on a GPU feeds its products 16-bit operands, as PyTorch's autocast and
//! Megatron's bf16 mode do: each product rounds `A` and `B` to the format (round to nearest
//! even; the weights already are, being stored in it) and accumulates in fp32, so a product
//! of depth `k` carries a relative error of about 2⁻⁸ per operand (bf16's 8 significant bits)
//! instead of fp32's 2⁻²⁴. Attention in a bf16 step runs the tensor-core FlashAttention
//! kernels (Q, K, V, P, dO and dS rounded to bf16; softmax and sums in fp32) where the head
//! size allows ([`crate::ops::attention_forward`]). The CPU kernels compute every product in fp32 whatever the format
//! here: they are the reference, and their bf16 runs keep 16-bit storage with fp32 compute
//! ([`Operands`] is ignored on host buffers).
//!
//! The format is the calling thread's, set for the duration of a step by the executor
//! ([`Scope`]) and carried into the kernel thread pool by [`crate::threads::install`], so the
//! model's code takes no extra argument. Every thread starts at fp32.

use std::cell::Cell;

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
}
