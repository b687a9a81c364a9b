//! Splitting a dimension into blocks of the loop nest. Each micro-kernel names its own block
//! sizes (`KC`, `MC`, `NC` of [`super::tile::Tile`], with the reasons beside each kernel);
//! [`block_len`] cuts a dimension into equal blocks of at most that size.

/// Splits `len` into the fewest blocks of at most `max` (a multiple of `unit`), all of equal
/// size rounded up to `unit` except the last: e.g. k = 688 → 344 + 344 rather than 512 + 176,
/// so no rank update is short (a short one pays the full `C` tile traffic for little work).
/// The depth blocks depend on `k` alone, never on `m` or `n`: see [`super::tile`] on batch
/// invariance.
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
