//! Own f32 GEMM in the GotoBLAS/BLIS design, one loop nest over three micro-kernels: operands
//! are packed into contiguous micro-panels sized to the cache levels, a register-blocked
//! micro-kernel computes each tile ([`tile::Tile`]: AVX-512 14 × 32 in [`kernel`], AVX2 + FMA
//! 6 × 16 in [`avx2`], plain Rust 4 × 8 in [`portable`]), a loop nest ([`driver`]) walks the
//! blocks, and [`parallel`] splits a product across the thread budget; packing buffers are per
//! thread and reused ([`scratch`]).
//!
//! Each element of `C` is summed in an order that depends on `k` alone: not on `m`, `n`, the
//! strides or the thread count. A row of a product therefore has the same bits however many
//! rows share the product (see [`tile`]), which keeps the parallel layouts equal to one
//! process where they regroup rows (expert parallelism gathers an expert's tokens from
//! several ranks into one product).
//!
//! `A` and `B` may have any strides (transposes are a stride swap, handled while packing);
//! `C` is row-major with a leading dimension. Callers pick a [`Kernel`] the CPU can run
//! ([`Kernel::available`]; [`Kernel::for_isa`] follows the kernel path of [`crate::isa`]).
//!
//! A fourth kernel, [`amx`], computes the same fp32 product on the AMX tile unit from an exact
//! three-way bf16 split of the operands ([`Kernel::Amx`]); it shares the threading
//! ([`parallel`]) and the staging of strided operands ([`pack`]).

#[cfg(target_arch = "x86_64")]
pub mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
mod blocking;
mod driver;
mod dynamic;
#[cfg(target_arch = "x86_64")]
mod kernel;
#[cfg(target_arch = "x86_64")]
mod pack;
mod parallel;
mod portable;
pub use parallel::splits_dynamically;
mod scratch;
#[cfg(test)]
mod tests;
mod tile;

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

/// The micro-kernel of a product.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kernel {
    /// AVX-512 FMA, 14 × 32 register tile ([`kernel`]).
    Avx512,
    /// AVX2 + FMA, 6 × 16 register tile ([`avx2`]).
    Avx2,
    /// Plain Rust, 4 × 8 tile ([`portable`]); runs on every CPU.
    Portable,
    /// AMX tiles on the exact bf16 split ([`amx`]), 32 × 32 blocks.
    Amx,
}

impl Kernel {
    /// The FMA kernels, widest first.
    pub const FMA: [Kernel; 3] = [Kernel::Avx512, Kernel::Avx2, Kernel::Portable];

    /// Whether this CPU (and OS, for AMX) can run the kernel (std caches the CPUID queries).
    pub fn available(self) -> bool {
        match self {
            Kernel::Portable => true,
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => crate::isa::Isa::Avx512.supported(),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => crate::isa::Isa::Avx2.supported(),
            #[cfg(target_arch = "x86_64")]
            Kernel::Amx => crate::isa::Isa::Avx512.supported() && amx::available(),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// The FMA kernel of a kernel path.
    pub fn for_isa(isa: crate::isa::Isa) -> Kernel {
        match isa {
            crate::isa::Isa::Avx512 => Kernel::Avx512,
            crate::isa::Isa::Avx2 => Kernel::Avx2,
            crate::isa::Isa::Portable => Kernel::Portable,
        }
    }

    /// The register tile `[MR, NR]` of an FMA kernel (`None` for AMX).
    pub fn tile(self) -> Option<[usize; 2]> {
        use tile::Tile;
        match self {
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx512 => Some([kernel::Avx512::MR, kernel::Avx512::NR]),
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => Some([avx2::Avx2::MR, avx2::Avx2::NR]),
            Kernel::Portable => Some([portable::Portable::MR, portable::Portable::NR]),
            _ => None,
        }
    }

    /// A short description for reports (`own SGEMM (AVX2+FMA, 6x16 tiles)`).
    pub fn describe(self) -> &'static str {
        match self {
            Kernel::Avx512 => "own SGEMM (AVX-512, 14x32 tiles)",
            Kernel::Avx2 => "own SGEMM (AVX2+FMA, 6x16 tiles)",
            Kernel::Portable => "own SGEMM (portable, 4x8 tiles)",
            Kernel::Amx => "own SGEMM (AMX, bf16x6 split)",
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
