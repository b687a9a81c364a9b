//! The AMX micro-kernel: one 32 × 32 block of `C` held in four 16 × 16 fp32 tile registers,
//! accumulating the six bf16 part products of [`super`] for every 32-deep step of `k`.
//!
//! Tile registers (palette 1, all configured 16 rows × 64 bytes): `tmm0..3` = the four `C`
//! quadrants, `tmm4/5` = the two 16-row halves of one `A` part, `tmm6/7` = the two 16-column
//! halves of one `B` part. Per step the pairs run from the smallest terms to the largest,
//! `(A₂,B₀) (A₁,B₁) (A₀,B₂)` (≈ 2⁻¹⁶ of `|a||b|`), `(A₀,B₁) (A₁,B₀)` (≈ 2⁻⁸), `(A₀,B₀)`, so the
//! small terms are summed before the large one lands on them (at `k = 1` this keeps the error
//! near fp32's single rounding); 20 tile loads feed 24 `tdpbf16ps` (each 16 × 16 × 32, 16
//! cycles). Every load is placed right after the last product that reads the register it
//! overwrites (tiles are not renamed).

use super::STEP_BYTES;
use std::arch::asm;

/// `ldtilecfg` operand: palette 1, eight tiles of 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    colsb: [u16; 16],
    rows: [u8; 16],
}

static CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    colsb: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// Loads the tile configuration on this thread (before any [`block`]).
///
/// # Safety
/// AMX must be available and permitted for the process (see [`super::available`]).
pub(super) unsafe fn configure() {
    asm!("ldtilecfg [{}]", in(reg) &CONFIG, options(nostack, readonly));
}

/// Returns this thread's tile state to its initial state (cheaper context switches).
///
/// # Safety
/// As for [`configure`].
pub(super) unsafe fn release() {
    asm!("tilerelease", options(nostack, nomem));
}

/// `C[32 × 32] (+)= Σ_steps Σ_pairs Aₚ·B_q` for the packed panels `a` and `b` (`steps` blocks
/// of [`STEP_BYTES`] each, see [`super::pack`]); `C(i, j) = c[i·ldc + j]`. `load = false`
/// starts from zero instead of `C`.
///
/// # Safety
/// [`configure`] must have run on this thread; `a`, `b` must hold `steps` packed steps
/// (64-byte aligned); all 32 × 32 addressed `C` elements must be writable and not accessed
/// concurrently.
pub(super) unsafe fn block(
    a: *const u8,
    b: *const u8,
    steps: usize,
    c: *mut f32,
    ldc: usize,
    load: bool,
) {
    let ld = ldc * 4;
    let c16 = c.add(16 * ldc);
    if load {
        asm!(
            "tileloadd tmm0, [{c} + {ld}*1]",
            "tileloadd tmm1, [{c} + {ld}*1 + 64]",
            "tileloadd tmm2, [{c16} + {ld}*1]",
            "tileloadd tmm3, [{c16} + {ld}*1 + 64]",
            c = in(reg) c, c16 = in(reg) c16, ld = in(reg) ld,
            options(nostack, readonly),
        );
    } else {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            options(nostack, nomem)
        );
    }
    // Offsets inside one step: part p, half h at (2p + h)·1024 bytes.
    asm!(
        "2:",
        // (A2, B0)
        "tileloadd tmm4, [{a} + {st}*1 + 4096]",
        "tileloadd tmm6, [{b} + {st}*1]",
        "tdpbf16ps tmm0, tmm4, tmm6",
        "prefetcht0 [{b} + 6144]",
        "prefetcht0 [{b} + 6208]",
        "prefetcht0 [{b} + 6272]",
        "prefetcht0 [{b} + 6336]",
        "tileloadd tmm5, [{a} + {st}*1 + 5120]",
        "tdpbf16ps tmm2, tmm5, tmm6",
        "prefetcht0 [{b} + 6400]",
        "prefetcht0 [{b} + 6464]",
        "prefetcht0 [{b} + 6528]",
        "prefetcht0 [{b} + 6592]",
        "tileloadd tmm7, [{b} + {st}*1 + 1024]",
        "tdpbf16ps tmm1, tmm4, tmm7",
        "prefetcht0 [{b} + 6656]",
        "prefetcht0 [{b} + 6720]",
        "prefetcht0 [{b} + 6784]",
        "prefetcht0 [{b} + 6848]",
        "tdpbf16ps tmm3, tmm5, tmm7",
        "prefetcht0 [{b} + 6912]",
        "prefetcht0 [{b} + 6976]",
        "prefetcht0 [{b} + 7040]",
        "prefetcht0 [{b} + 7104]",
        // (A1, B1)
        "tileloadd tmm4, [{a} + {st}*1 + 2048]",
        "tileloadd tmm6, [{b} + {st}*1 + 2048]",
        "tdpbf16ps tmm0, tmm4, tmm6",
        "prefetcht0 [{b} + 7168]",
        "prefetcht0 [{b} + 7232]",
        "prefetcht0 [{b} + 7296]",
        "prefetcht0 [{b} + 7360]",
        "tileloadd tmm5, [{a} + {st}*1 + 3072]",
        "tdpbf16ps tmm2, tmm5, tmm6",
        "prefetcht0 [{b} + 7424]",
        "prefetcht0 [{b} + 7488]",
        "prefetcht0 [{b} + 7552]",
        "prefetcht0 [{b} + 7616]",
        "tileloadd tmm7, [{b} + {st}*1 + 3072]",
        "tdpbf16ps tmm1, tmm4, tmm7",
        "prefetcht0 [{b} + 7680]",
        "prefetcht0 [{b} + 7744]",
        "prefetcht0 [{b} + 7808]",
        "prefetcht0 [{b} + 7872]",
        "tdpbf16ps tmm3, tmm5, tmm7",
        "prefetcht0 [{b} + 7936]",
        "prefetcht0 [{b} + 8000]",
        "prefetcht0 [{b} + 8064]",
        "prefetcht0 [{b} + 8128]",
        // (A0, B2)
        "tileloadd tmm4, [{a} + {st}*1]",
        "tileloadd tmm6, [{b} + {st}*1 + 4096]",
        "tdpbf16ps tmm0, tmm4, tmm6",
        "prefetcht0 [{b} + 8192]",
        "prefetcht0 [{b} + 8256]",
        "prefetcht0 [{b} + 8320]",
        "prefetcht0 [{b} + 8384]",
        "tileloadd tmm5, [{a} + {st}*1 + 1024]",
        "tdpbf16ps tmm2, tmm5, tmm6",
        "prefetcht0 [{b} + 8448]",
        "prefetcht0 [{b} + 8512]",
        "prefetcht0 [{b} + 8576]",
        "prefetcht0 [{b} + 8640]",
        "tileloadd tmm7, [{b} + {st}*1 + 5120]",
        "tdpbf16ps tmm1, tmm4, tmm7",
        "prefetcht0 [{b} + 8704]",
        "prefetcht0 [{b} + 8768]",
        "prefetcht0 [{b} + 8832]",
        "prefetcht0 [{b} + 8896]",
        "tdpbf16ps tmm3, tmm5, tmm7",
        "prefetcht0 [{b} + 8960]",
        "prefetcht0 [{b} + 9024]",
        "prefetcht0 [{b} + 9088]",
        "prefetcht0 [{b} + 9152]",
        // (A0, B1)
        "tileloadd tmm6, [{b} + {st}*1 + 2048]",
        "tdpbf16ps tmm0, tmm4, tmm6",
        "prefetcht0 [{b} + 9216]",
        "prefetcht0 [{b} + 9280]",
        "prefetcht0 [{b} + 9344]",
        "prefetcht0 [{b} + 9408]",
        "tdpbf16ps tmm2, tmm5, tmm6",
        "prefetcht0 [{b} + 9472]",
        "prefetcht0 [{b} + 9536]",
        "prefetcht0 [{b} + 9600]",
        "prefetcht0 [{b} + 9664]",
        "tileloadd tmm7, [{b} + {st}*1 + 3072]",
        "tdpbf16ps tmm1, tmm4, tmm7",
        "prefetcht0 [{b} + 9728]",
        "prefetcht0 [{b} + 9792]",
        "prefetcht0 [{b} + 9856]",
        "prefetcht0 [{b} + 9920]",
        "tdpbf16ps tmm3, tmm5, tmm7",
        "prefetcht0 [{b} + 9984]",
        "prefetcht0 [{b} + 10048]",
        "prefetcht0 [{b} + 10112]",
        "prefetcht0 [{b} + 10176]",
        // (A1, B0)
        "tileloadd tmm4, [{a} + {st}*1 + 2048]",
        "tileloadd tmm6, [{b} + {st}*1]",
        "tdpbf16ps tmm0, tmm4, tmm6",
        "prefetcht0 [{b} + 10240]",
        "prefetcht0 [{b} + 10304]",
        "prefetcht0 [{b} + 10368]",
        "prefetcht0 [{b} + 10432]",
        "tileloadd tmm5, [{a} + {st}*1 + 3072]",
        "tdpbf16ps tmm2, tmm5, tmm6",
        "prefetcht0 [{b} + 10496]",
        "prefetcht0 [{b} + 10560]",
        "prefetcht0 [{b} + 10624]",
        "prefetcht0 [{b} + 10688]",
        "tileloadd tmm7, [{b} + {st}*1 + 1024]",
        "tdpbf16ps tmm1, tmm4, tmm7",
        "prefetcht0 [{b} + 10752]",
        "prefetcht0 [{b} + 10816]",
        "prefetcht0 [{b} + 10880]",
        "prefetcht0 [{b} + 10944]",
        "tdpbf16ps tmm3, tmm5, tmm7",
        "prefetcht0 [{b} + 11008]",
        "prefetcht0 [{b} + 11072]",
        "prefetcht0 [{b} + 11136]",
        "prefetcht0 [{b} + 11200]",
        // (A0, B0)
        "tileloadd tmm4, [{a} + {st}*1]",
        "tdpbf16ps tmm0, tmm4, tmm6",
        "prefetcht0 [{b} + 11264]",
        "prefetcht0 [{b} + 11328]",
        "prefetcht0 [{b} + 11392]",
        "prefetcht0 [{b} + 11456]",
        "tileloadd tmm5, [{a} + {st}*1 + 1024]",
        "tdpbf16ps tmm2, tmm5, tmm6",
        "prefetcht0 [{b} + 11520]",
        "prefetcht0 [{b} + 11584]",
        "prefetcht0 [{b} + 11648]",
        "prefetcht0 [{b} + 11712]",
        "tdpbf16ps tmm1, tmm4, tmm7",
        "prefetcht0 [{b} + 11776]",
        "prefetcht0 [{b} + 11840]",
        "prefetcht0 [{b} + 11904]",
        "prefetcht0 [{b} + 11968]",
        "tdpbf16ps tmm3, tmm5, tmm7",
        "prefetcht0 [{b} + 12032]",
        "prefetcht0 [{b} + 12096]",
        "prefetcht0 [{b} + 12160]",
        "prefetcht0 [{b} + 12224]",
        "add {a}, {step}",
        "add {b}, {step}",
        "dec {n}",
        "jnz 2b",
        a = inout(reg) a => _,
        b = inout(reg) b => _,
        n = inout(reg) steps => _,
        st = in(reg) 64usize,
        step = const STEP_BYTES,
        options(nostack, readonly),
    );
    asm!(
        "tilestored [{c} + {ld}*1], tmm0",
        "tilestored [{c} + {ld}*1 + 64], tmm1",
        "tilestored [{c16} + {ld}*1], tmm2",
        "tilestored [{c16} + {ld}*1 + 64], tmm3",
        c = in(reg) c, c16 = in(reg) c16, ld = in(reg) ld,
        options(nostack),
    );
}
