//! Own f32 GEMM in the GotoBLAS/BLIS design, for AVX-512 CPUs: operands are packed into
//! contiguous micro-panels ([`pack`]) sized to the cache levels ([`blocking`]), a 14 × 32
//! register-blocked micro-kernel ([`kernel`]) computes each tile, a loop nest ([`driver`])
//! walks the blocks, and [`parallel`] splits a product across the thread budget; packing
//! buffers are per thread and reused ([`scratch`]).
//!
//! `A` and `B` may have any strides (transposes are a stride swap, handled while packing);
//! `C` is row-major with a leading dimension. Callers check [`available`] first; on other
//! CPUs [`crate::gemm`] uses the `gemm` crate.
//!
//! A second micro-kernel, [`amx`], computes the same fp32 product on the AMX tile unit from
//! an exact three-way bf16 split of the operands ([`Kernel::Amx`]); it shares the threading
//! ([`parallel`]) and the staging of strided operands ([`pack`]).

pub mod amx;
mod blocking;
mod driver;
mod dynamic;
mod kernel;
mod pack;
mod parallel;
pub use parallel::splits_dynamically;
mod scratch;
#[cfg(test)]
mod tests;

/// A read-only strided matrix: element `(i, j)` is at `ptr[i·rs + j·cs]`.
#[derive(Debug, Clone, Copy)]
pub struct MatRef {
    pub ptr: *const f32,
    pub rs: isize,
    pub cs: isize,
}

impl MatRef {
    /// Pointer to element `(i, j)`.
    ///
    /// # Safety
    /// The element must lie inside the allocation `ptr` points into.
    #[inline(always)]
    pub(crate) unsafe fn at(self, i: usize, j: usize) -> *const f32 {
        self.ptr.offset(i as isize * self.rs + j as isize * self.cs)
    }

    /// The submatrix starting at `(i, j)`.
    ///
    /// # Safety
    /// As for [`MatRef::at`].
    #[inline(always)]
    pub(crate) unsafe fn sub(self, i: usize, j: usize) -> MatRef {
        MatRef {
            ptr: self.at(i, j),
            ..self
        }
    }
}

/// Whether this CPU can run the kernel (AVX-512F; std caches the CPUID query).
#[inline]
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The micro-kernel of a product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// AVX-512 FMA, 14 × 32 register tile ([`kernel`]).
    Fma,
    /// AMX tiles on the exact bf16 split ([`amx`]), 32 × 32 blocks.
    Amx,
}

impl Kernel {
    /// Whether this CPU (and OS, for AMX) can run the kernel.
    pub fn available(self) -> bool {
        match self {
            Kernel::Fma => available(),
            Kernel::Amx => available() && amx::available(),
        }
    }
}

/// `C[m × n] (+)= A[m × k] · B[k × n]` with `C(i, j) = c[i·ldc + j]`, on up to `threads`
/// threads of the budget pool (`threads ≤ 1` runs on the calling thread). `k = 0` writes
/// zeros (or leaves `C` when accumulating).
///
/// # Safety
/// `kernel.available()` must be true; every addressed element of `A`, `B` and `C` must be in bounds;
/// `C` must not overlap `A` or `B` and must not be accessed by anyone else during the call.
#[allow(clippy::too_many_arguments)]
pub unsafe fn sgemm_with(
    kernel: Kernel,
    c: *mut f32,
    ldc: usize,
    a: MatRef,
    b: MatRef,
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
    threads: usize,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                std::slice::from_raw_parts_mut(c.add(i * ldc), n).fill(0.0);
            }
        }
        return;
    }
    parallel::run(kernel, c, ldc, a, b, [m, k, n], accumulate, threads)
}
