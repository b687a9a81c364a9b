//! Resharding flat shards: turn the shards saved by `old_world` ranks into the shard a rank of
//! a new world (different dp size, or a different ZeRO stage, where DDP is world 1) needs.
//!
//! Shards are equal padded contiguous ranges of one flat buffer (see [`crate::shard`]), so
//! resharding is interval arithmetic: new range `[a, b)` is the concatenation of its
//! intersections with the old ranges; padding is zero.
use std::ops::Range;

use crate::shard::ShardSpec;
use crate::ParallelError;

/// One copy: `len` elements from old shard `old_rank` at local offset `src` to the new shard at
/// local offset `dst`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    pub old_rank: usize,
    pub src: Range<usize>,
    pub dst: Range<usize>,
}

/// The copies that assemble `new_rank`'s shard of `new` from shards of `old` (same total).
pub fn plan(
    old: &ShardSpec,
    new: &ShardSpec,
    new_rank: usize,
) -> Result<Vec<Piece>, ParallelError> {
    if old.total() != new.total() {
        return Err(ParallelError::Layout(format!(
            "cannot reshard: saved buffer has {} elements, the model has {}",
            old.total(),
            new.total()
        )));
    }
    if new_rank >= new.world() {
        return Err(ParallelError::Config(format!(
            "rank {new_rank} outside world {}",
            new.world()
        )));
    }
    let want = new.range(new_rank);
    let base = new_rank * new.shard_len();
    Ok(old
        .split(want)
        .into_iter()
        .map(|(old_rank, r)| Piece {
            old_rank,
            src: old.to_local(old_rank, &r),
            dst: r.start - base..r.end - base,
        })
        .collect())
}

/// Assembles `new_rank`'s padded shard (length `new.shard_len()`) from the old shards, which
/// must each hold at least the real part of their range.
pub fn reshard(
    old: &ShardSpec,
    old_shards: &[&[f32]],
    new: &ShardSpec,
    new_rank: usize,
) -> Result<Vec<f32>, ParallelError> {
    if old_shards.len() != old.world() {
        return Err(ParallelError::Layout(format!(
            "expected {} saved shards, found {}",
            old.world(),
            old_shards.len()
        )));
    }
    for (r, s) in old_shards.iter().enumerate() {
        if s.len() < old.range(r).len() {
            return Err(ParallelError::Layout(format!(
                "saved shard {r} holds {} elements, its range needs {}",
                s.len(),
                old.range(r).len()
            )));
        }
    }
    let mut out = vec![0.0; new.shard_len()];
    for p in plan(old, new, new_rank)? {
        out[p.dst].copy_from_slice(&old_shards[p.old_rank][p.src]);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn shards_of(full: &[f32], spec: &ShardSpec) -> Vec<Vec<f32>> {
        (0..spec.world())
            .map(|r| {
                let mut s = vec![0.0; spec.shard_len()];
                let range = spec.range(r);
                s[..range.len()].copy_from_slice(&full[range]);
                s
            })
            .collect()
    }

    proptest! {
        #[test]
        fn reshard_equals_direct_sharding(total in 1usize..200, old_n in 1usize..6, new_n in 1usize..6) {
            let full: Vec<f32> = (0..total).map(|i| i as f32 + 1.0).collect();
            let old = ShardSpec::new(total, old_n).unwrap();
            let new = ShardSpec::new(total, new_n).unwrap();
            let old_shards = shards_of(&full, &old);
            let refs: Vec<&[f32]> = old_shards.iter().map(|s| s.as_slice()).collect();
            let want = shards_of(&full, &new);
            for (r, w) in want.iter().enumerate() {
                prop_assert_eq!(&reshard(&old, &refs, &new, r).unwrap(), w);
            }
        }
    }

    #[test]
    fn mismatched_layouts_are_errors() {
        let old = ShardSpec::new(10, 2).unwrap();
        let new = ShardSpec::new(11, 2).unwrap();
        assert!(plan(&old, &new, 0).is_err());
        let a = [0.0f32; 5];
        assert!(reshard(&old, &[&a], &old, 0).is_err());
        assert!(reshard(&old, &[&a, &a[..2]], &old, 0).is_err());
    }
}
