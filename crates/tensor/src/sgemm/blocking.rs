//! Block sizes of the loop nest, chosen for this kernel and a core with 48 KiB L1d and
//! 2 MiB L2 (Sapphire Rapids; reasonable for other AVX-512 Xeons).
//!
//! - `MR × NR = 14 × 32`: the register tile (see [`super::kernel`]).
//! - `KC = 512`: depth of one rank-`KC` update. The packed `A` micro-panel (`MR × KC`
//!   floats = 28 KiB) stays in L1 while the kernel walks across the packed `B` block; a deep
//!   `KC` halves the `C` tile traffic per multiply-add compared with 256 (each tile of `C` is
//!   read and written once per `KC` steps).
//! - `NC = 512`: columns of the packed `B` block (`KC × NC` floats = 1 MiB), resident in L2
//!   while every row panel of `A` passes over it; its `NR`-wide micro-panels stream from L2
//!   (128 bytes per 14 cycles, far below L2 bandwidth).
//!
//! (A classic BLIS order with the `B` micro-panel in L1 and `KC = 256` measured 10–15 %
//! slower here: a 32 KiB `B` panel plus the streaming `A` panel overfill the 48 KiB L1.)

/// Rows of the register tile (broadcast operand).
pub(crate) const MR: usize = 14;
/// Columns of the register tile (two 16-lane vectors).
pub(crate) const NR: usize = 32;
/// Depth of one packed rank-`KC` update.
pub(crate) const KC: usize = 512;
/// Rows of a packed `A` block when `n` needs several `B` blocks (a multiple of `MR`, ≥ 2048 so
/// that 2048-row products use one block; 4.2 MiB of packed `A` at `KC = 512`, read back from
/// L3 panel by panel).
pub(crate) const MC: usize = MR * 150;
/// Columns of a packed `B` block (a multiple of `NR`).
pub(crate) const NC: usize = NR * 16;

/// Splits `len` into the fewest blocks of at most `max` (a multiple of `unit`), all of equal
/// size rounded up to `unit` except the last: e.g. k = 688 → 344 + 344 rather than 512 + 176,
/// so no rank update is short (a short one pays the full `C` tile traffic for little work).
pub(crate) fn block_len(len: usize, max: usize, unit: usize) -> usize {
    let blocks = len.div_ceil(max);
    len.div_ceil(blocks).next_multiple_of(unit).min(max)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_blocks() {
        assert_eq!(block_len(688, 512, 1), 344);
        assert_eq!(block_len(1376, 512, 1), 459);
        assert_eq!(block_len(512, 512, 1), 512);
        assert_eq!(block_len(7, 512, 1), 7);
        assert_eq!(block_len(688, 512, 32), 352);
        assert_eq!(block_len(2048, 512, 32), 512);
        assert_eq!(block_len(1, 512, 32), 32);
        // Never more blocks than the plain split, never over the maximum.
        for len in 1..2000 {
            let b = block_len(len, 512, 32);
            assert!(
                b <= 512 && b.is_multiple_of(32) && len.div_ceil(b) == len.div_ceil(512),
                "{len}"
            );
        }
    }
}
