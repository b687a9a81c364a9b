//! Flat sharding math: one flat buffer of `total` elements cut into `world` equal, padded,
//! contiguous ranges (ZeRO's partitioning of the flattened parameters).
//!
//! Every rank owns `shard_len = ceil(total / world)` elements; the last ranks' ranges may run
//! past `total` (padding) or be entirely padding. Padding elements are never read from or
//! written to the real buffer; inside a shard they are kept at zero, so they add nothing to a
//! sum such as a gradient norm.
use std::ops::Range;

use crate::ParallelError;

/// The equal padded partition of a flat buffer over the ranks of a data-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardSpec {
    total: usize,
    world: usize,
    shard_len: usize,
}

impl ShardSpec {
    /// Partition `total` elements over `world` ranks.
    pub fn new(total: usize, world: usize) -> Result<Self, ParallelError> {
        if world == 0 {
            return Err(ParallelError::Config(
                "data-parallel world size must be at least 1".into(),
            ));
        }
        Ok(Self {
            total,
            world,
            shard_len: total.div_ceil(world),
        })
    }

    /// Number of real (unpadded) elements in the flat buffer.
    pub fn total(&self) -> usize {
        self.total
    }

    pub fn world(&self) -> usize {
        self.world
    }

    /// Elements every rank stores: `ceil(total / world)`.
    pub fn shard_len(&self) -> usize {
        self.shard_len
    }

    /// `world * shard_len`: the flat buffer length including padding.
    pub fn padded_total(&self) -> usize {
        self.world * self.shard_len
    }

    /// The padded range of `rank` in flat coordinates (may extend past `total`).
    pub fn padded_range(&self, rank: usize) -> Range<usize> {
        rank * self.shard_len..(rank + 1) * self.shard_len
    }

    /// The real (unpadded) range of `rank` in flat coordinates; empty for an all-padding shard.
    pub fn range(&self, rank: usize) -> Range<usize> {
        let start = (rank * self.shard_len).min(self.total);
        let end = ((rank + 1) * self.shard_len).min(self.total);
        start..end
    }

    /// The rank that owns flat element `i` (`i < total`).
    pub fn owner(&self, i: usize) -> usize {
        i / self.shard_len.max(1)
    }

    /// Cuts the flat range `r` at shard boundaries: `(rank, flat sub-range)` pieces in order,
    /// covering `r` exactly (empty pieces omitted). A bucket reduce-scatter sends piece `k` to
    /// its rank.
    pub fn split(&self, r: Range<usize>) -> Vec<(usize, Range<usize>)> {
        let mut out = Vec::new();
        if r.is_empty() || self.shard_len == 0 {
            return out;
        }
        let mut start = r.start;
        while start < r.end {
            let rank = self.owner(start);
            let end = r.end.min((rank + 1) * self.shard_len);
            out.push((rank, start..end));
            start = end;
        }
        out
    }

    /// The part of flat range `r` that `rank` owns, in flat coordinates (possibly empty).
    pub fn intersect(&self, rank: usize, r: &Range<usize>) -> Range<usize> {
        let own = self.range(rank);
        let start = own.start.max(r.start);
        let end = own.end.min(r.end).max(start);
        start..end
    }

    /// Converts a flat range inside `rank`'s shard to local offsets within the shard.
    pub fn to_local(&self, rank: usize, r: &Range<usize>) -> Range<usize> {
        let base = rank * self.shard_len;
        r.start - base..r.end - base
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn equal_padded_ranges() {
        let s = ShardSpec::new(10, 4).unwrap();
        assert_eq!(s.shard_len(), 3);
        assert_eq!(s.padded_total(), 12);
        assert_eq!(s.range(0), 0..3);
        assert_eq!(s.range(3), 9..10);
        assert_eq!(s.padded_range(3), 9..12);
        // More ranks than elements: trailing shards are pure padding.
        let s = ShardSpec::new(2, 4).unwrap();
        assert_eq!(s.range(2), 2..2);
        assert!(ShardSpec::new(5, 0).is_err());
    }

    #[test]
    fn split_cuts_at_shard_boundaries() {
        let s = ShardSpec::new(10, 4).unwrap();
        assert_eq!(s.split(2..8), vec![(0, 2..3), (1, 3..6), (2, 6..8)]);
        assert_eq!(s.intersect(1, &(2..8)), 3..6);
        assert_eq!(s.intersect(3, &(2..8)), 9..9);
        assert_eq!(s.to_local(2, &(6..8)), 0..2);
    }

    proptest! {
        #[test]
        fn ranges_partition_the_buffer(total in 0usize..500, world in 1usize..9) {
            let s = ShardSpec::new(total, world).unwrap();
            let mut next = 0;
            for r in 0..world {
                let range = s.range(r);
                prop_assert_eq!(range.start, next);
                prop_assert!(range.len() <= s.shard_len());
                next = range.end;
            }
            prop_assert_eq!(next, total);
            prop_assert!(s.padded_total() >= total && s.padded_total() < total + world);
        }

        #[test]
        fn split_covers_the_range(total in 1usize..300, world in 1usize..7, a in 0usize..300, b in 0usize..300) {
            let s = ShardSpec::new(total, world).unwrap();
            let (a, b) = (a.min(b).min(total), a.max(b).min(total));
            let pieces = s.split(a..b);
            let mut next = a;
            for (rank, p) in &pieces {
                prop_assert_eq!(p.start, next);
                prop_assert_eq!(s.intersect(*rank, &(a..b)), p.clone());
                next = p.end;
            }
            prop_assert_eq!(next, b);
        }
    }
}
