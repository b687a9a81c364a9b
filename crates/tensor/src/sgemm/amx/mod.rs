//! fp32 GEMM on Intel AMX: each fp32 operand is split exactly into three bf16 parts and the
//! product is assembled from the six part products that matter, accumulated in fp32 by the
//! tile unit (`tdpbf16ps`: 16 × 16 × 32 multiply-adds per instruction, 16× the multiply-add
//! rate of the AVX-512 FMA units per core on Sapphire Rapids).
//!
//! The math: with `x = x₁ + x₂ + x₃` (`x₁ = bf16(x)`, `x₂ = bf16(x − x₁)`, `x₃ = x − x₁ − x₂`;
//! bf16 keeps 8 significant bits, so `|x₂| ≤ 2⁻⁸|x|`, `|x₃| ≤ 2⁻¹⁷|x|` and `x₃` is itself a
//! bf16 value), `a·b = Σᵢⱼ aᵢbⱼ` exactly. The kernel sums
//! `a₁b₁ + a₁b₂ + a₂b₁ + a₁b₃ + a₂b₂ + a₃b₁` and drops `a₂b₃ + a₃b₂ + a₃b₃`, whose magnitude is
//! at most `≈ 2⁻²⁵|a||b|`, half of fp32's unit roundoff `u = 2⁻²⁴`. Each bf16 × bf16 product is
//! exact in fp32 (8 × 8 significant bits), so the result carries the error of an fp32
//! accumulation (six terms per `k` instead of one) plus that truncation: the same accuracy
//! class as an fp32 FMA kernel, checked against an f64 reference in the tests. This is the
//! "bf16x6" variant of the bf16-split fp32 emulations (cf. bf16x9 in cuBLAS).
//!
//! Limits, by construction of the tile unit: bf16 inputs below 2⁻¹²⁶ are read as zero and
//! subnormal results are flushed (only the low parts of values below ≈ 2⁻¹⁰⁸ are affected),
//! a finite input within 2⁻⁹ of `f32::MAX` rounds to ±∞ in its high part, and an infinite
//! input times a value whose lower parts are zero gives NaN (∞ · 0 in a part product) where
//! fp32 gives ±∞; NaN inputs give NaN. Non-finite inputs therefore stay non-finite.
//!
//! Layout and loops: [`pack`] (split + tile layouts), [`kernel`] (the 32 × 32 tile block),
//! [`driver`] (blocking); threads split `C` like the FMA path ([`super::parallel`]).

mod driver;
mod kernel;
mod pack;

pub(super) use driver::gemm;

/// Bytes of one packed 32-deep step of a 32-wide panel: 3 parts × 2 halves × 1 KiB tiles.
pub(super) const STEP_BYTES: usize = 6 * 1024;
/// Depth of one rank update: the packed `A` panel (`KC/32` steps, 24 KiB) stays in L1.
pub(super) const KC: usize = 128;
/// Columns of one packed `B` block (`NC/32 · KC/32` steps, 192 KiB), resident in L2.
pub(super) const NC: usize = 1024;

/// Whether this CPU and OS can run the AMX path: AMX-TILE, AMX-BF16, AVX-512BW and
/// AVX-512-BF16 (the split) present, the process granted the tile state
/// (`arch_prctl(ARCH_REQ_XCOMP_PERM)`, Linux ≥ 5.16).
/// Queried once per process.
pub fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::__cpuid_count;
    if !std::arch::is_x86_feature_detected!("avx512bw")
        || !std::arch::is_x86_feature_detected!("avx512bf16")
    {
        return false;
    }
    // CPUID.(EAX=7, ECX=0):EDX bit 22 = AMX-BF16, bit 24 = AMX-TILE.
    // CPUID leaf 7 exists on every x86-64 CPU with AVX-512.
    let edx = __cpuid_count(7, 0).edx;
    if edx & (1 << 22) == 0 || edx & (1 << 24) == 0 {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a plain syscall with integer arguments; failure is reported by the return value.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    rc == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}
