//! Context parallelism: each sequence is split over the `cp` ranks of a group, every rank
//! runs the whole model on its share of the tokens, and attention — the one layer that mixes
//! tokens — sees the other ranks' keys and values through [`ring::ContextAttention`] (ring
//! attention, or gathering them all at once).
//!
//! Which tokens a rank holds ([`CpLayout`], `--cp-balance`):
//!
//! | balance | rank r of cp holds (sequence of S tokens) | causal work per rank |
//! |---------|--------------------------------------------|----------------------|
//! | `none` | positions `r·S/cp ..` (one block) | grows with r: the last rank ≈ 2× the mean |
//! | `zigzag` | chunks r and 2·cp − 1 − r of 2·cp chunks | equal |
//! | `striped` | positions r, r + cp, r + 2·cp, … | equal to within one token per row |
//!
//! The rest of the model is per token: the embedding, norms, MLP / experts and the head run
//! on the local tokens; RoPE uses their global positions. The loss is the mean over every
//! valid token of the sequence: each rank knows the whole micro-batch (so the global count),
//! sums its own tokens' losses, and the sum over cp is the loss. Gradients are averaged over
//! dp × cp, so each rank seeds its share `cp` times larger (Megatron's convention).
pub mod ring;

use comm::ProcessGroup;
use model::layers::{SeqPart, SequenceGroup};

use crate::ParallelError;

/// How a sequence is split over the cp ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CpBalance {
    /// Contiguous blocks.
    None,
    /// Two chunks per rank, r and 2·cp − 1 − r (the default).
    #[default]
    Zigzag,
    /// Every cp-th token.
    Striped,
}

impl std::str::FromStr for CpBalance {
    type Err = ParallelError;
    fn from_str(s: &str) -> Result<Self, ParallelError> {
        match s {
            "none" => Ok(CpBalance::None),
            "zigzag" => Ok(CpBalance::Zigzag),
            "striped" => Ok(CpBalance::Striped),
            other => Err(ParallelError::Config(format!(
                "cp balance `{other}` (expected none, zigzag or striped)"
            ))),
        }
    }
}

/// How the keys and values reach the other ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CpComm {
    /// Ring attention: blocks pass around the ring, each step's transfer overlapped with the
    /// attention of the block at hand; dK and dV travel back to their owners the same way.
    #[default]
    Ring,
    /// Gather every rank's K and V at once (Llama 3's form), reduce-scatter dK and dV.
    AllGather,
}

impl std::str::FromStr for CpComm {
    type Err = ParallelError;
    fn from_str(s: &str) -> Result<Self, ParallelError> {
        match s {
            "ring" => Ok(CpComm::Ring),
            "allgather" => Ok(CpComm::AllGather),
            other => Err(ParallelError::Config(format!(
                "cp communication `{other}` (expected ring or allgather)"
            ))),
        }
    }
}

/// One rank's share of every sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpLayout {
    pub cp: usize,
    pub rank: usize,
    pub balance: CpBalance,
}

impl CpLayout {
    /// Checks that sequences of `seq` tokens split under this layout.
    pub fn check(&self, seq: usize) -> Result<(), ParallelError> {
        let pieces = match self.balance {
            CpBalance::Zigzag => 2 * self.cp,
            _ => self.cp,
        };
        if self.cp == 0 || self.rank >= self.cp || seq == 0 || !seq.is_multiple_of(pieces) {
            return Err(ParallelError::Config(format!(
                "a sequence of {seq} tokens does not split into {pieces} equal pieces ({:?} balance over cp = {}{})",
                self.balance,
                self.cp,
                if self.balance == CpBalance::Zigzag {
                    ": zigzag needs seq_len divisible by 2·cp"
                } else {
                    ""
                }
            )));
        }
        Ok(())
    }

    /// Tokens of each sequence a rank holds.
    pub fn local_len(&self, seq: usize) -> usize {
        seq / self.cp
    }

    /// The positions rank `r` holds.
    pub fn part_of(&self, r: usize, seq: usize) -> SeqPart {
        match self.balance {
            CpBalance::None => SeqPart::Offset(r * self.local_len(seq)),
            CpBalance::Zigzag => SeqPart::Chunks {
                first: r,
                second: 2 * self.cp - 1 - r,
            },
            CpBalance::Striped => SeqPart::Strided {
                first: r,
                stride: self.cp,
            },
        }
    }

    /// The positions this rank holds.
    pub fn part(&self, seq: usize) -> SeqPart {
        self.part_of(self.rank, seq)
    }

    /// This rank's tokens of `batch` sequences of `seq` tokens each (`full` is row-major
    /// `[batch, seq, width]`), sequence after sequence.
    pub fn slice<T: Copy>(&self, full: &[T], batch: usize, seq: usize, width: usize) -> Vec<T> {
        let pos = self.part(seq).positions(self.local_len(seq));
        let mut out = Vec::with_capacity(batch * pos.len() * width);
        for b in 0..batch {
            for &p in &pos {
                let at = (b * seq + p) * width;
                out.extend_from_slice(&full[at..at + width]);
            }
        }
        out
    }
}

/// The cp group as the model's [`SequenceGroup`]: sums of per-sequence statistics (the MoE
/// auxiliary loss's), added in rank order so that every rank gets the same bits.
#[derive(Debug)]
pub struct CpGroup(pub ProcessGroup);

impl SequenceGroup for CpGroup {
    fn sum(&self, x: &mut [f64]) -> model::Result<()> {
        let n = self.0.size();
        if n == 1 {
            return Ok(());
        }
        let bits: Vec<i64> = x.iter().map(|v| v.to_bits() as i64).collect();
        let mut all = vec![0i64; n * x.len()];
        self.0
            .all_gather(&bits, &mut all)
            .map_err(|e| model::ModelError::Collective(format!("context-parallel sum: {e}")))?;
        let len = x.len();
        for (i, v) in x.iter_mut().enumerate() {
            *v = (0..n)
                .map(|r| f64::from_bits(all[r * len + i] as u64))
                .sum();
        }
        Ok(())
    }
}

/// One kernel call of a (query part, key part) pair, per sequence: local query rows and key
/// rows, and the offsets that make the kernel's causal rule (`k_start + j ≤ q_start + i`) the
/// true one for these rows. Key row `k_rows.start + j` is at global position
/// `k_pos0 + j·k_stride` (what [`BlockCall::first_key`] needs for a document mask).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockCall {
    pub q_rows: std::ops::Range<usize>,
    pub k_rows: std::ops::Range<usize>,
    pub q_start: usize,
    pub k_start: usize,
    pub k_pos0: usize,
    pub k_stride: usize,
}

impl BlockCall {
    /// The kernel's `doc_start` for a query whose document starts at global position `start`:
    /// the first key of this call, in the kernel's frame (key `j` at `k_start + j`), at or after
    /// `start`. Key `j` is at global position `k_pos0 + j·k_stride`, which is `≥ start` iff
    /// `j ≥ ⌈(start − k_pos0)/k_stride⌉` (0 when `start ≤ k_pos0`). For blocks and zigzag
    /// chunks the frame is the global positions (`k_start = k_pos0`, stride 1) and this is
    /// `max(start, k_start)`; for stripes it is a local key index.
    pub fn first_key(&self, start: usize) -> usize {
        self.k_start + start.saturating_sub(self.k_pos0).div_ceil(self.k_stride)
    }
}

/// The kernel calls of local queries at `q` against keys at `k` (`len` tokens each), skipping
/// pairs with no visible key.
///
/// - Blocks at offsets a, b: one call with the global offsets.
/// - Zigzag chunks (length c = len/2): each (query chunk, key chunk) pair with the key chunk
///   not after the query chunk, at global offsets chunk·c.
/// - Stripes (query positions t·cp + i, keys s·cp + j): key s is visible to query t iff
///   s·cp + j ≤ t·cp + i, i.e. s ≤ t when j ≤ i and s < t when j > i — the kernel's rule on
///   local indices with `k_start = 1` in the second case.
pub fn block_calls(q: SeqPart, k: SeqPart, len: usize) -> Vec<BlockCall> {
    match (q, k) {
        (SeqPart::Offset(a), SeqPart::Offset(b)) => (b < a + len)
            .then_some(BlockCall {
                q_rows: 0..len,
                k_rows: 0..len,
                q_start: a,
                k_start: b,
                k_pos0: b,
                k_stride: 1,
            })
            .into_iter()
            .collect(),
        (
            SeqPart::Chunks {
                first: qa,
                second: qb,
            },
            SeqPart::Chunks {
                first: ka,
                second: kb,
            },
        ) => {
            let c = len / 2;
            let mut v = Vec::new();
            for (qi, qc) in [(0, qa), (1, qb)] {
                for (ki, kc) in [(0, ka), (1, kb)] {
                    if kc <= qc {
                        v.push(BlockCall {
                            q_rows: qi * c..qi * c + c,
                            k_rows: ki * c..ki * c + c,
                            q_start: qc * c,
                            k_start: kc * c,
                            k_pos0: kc * c,
                            k_stride: 1,
                        });
                    }
                }
            }
            v
        }
        (
            SeqPart::Strided { first: i, .. },
            SeqPart::Strided {
                first: j,
                stride: cp,
            },
        ) => {
            let k_start = usize::from(j > i);
            // With k_start = 1 and one token per rank, no key is visible.
            (k_start < len)
                .then_some(BlockCall {
                    q_rows: 0..len,
                    k_rows: 0..len,
                    q_start: 0,
                    k_start,
                    k_pos0: j,
                    k_stride: cp,
                })
                .into_iter()
                .collect()
        }
        _ => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The calls reproduce the causal mask of the global positions exactly: for every pair of
    /// ranks, every (query, key) pair of local rows is visible in exactly one call iff its key
    /// position is not after its query position — and, under a document mask (documents
    /// opening at `opens`), iff it is moreover not before the query's document start, the
    /// kernel's rule with [`BlockCall::first_key`] as `doc_start`.
    #[test]
    fn block_calls_are_the_causal_mask() {
        for docs in [None, Some(&[0usize, 3, 4, 11, 17][..])] {
            block_calls_mask(docs);
        }
    }

    fn block_calls_mask(opens: Option<&[usize]>) {
        let doc_start = |p: usize| {
            opens.map_or(0, |o| {
                o.iter().copied().filter(|&x| x <= p).max().unwrap_or(0)
            })
        };
        for balance in [CpBalance::None, CpBalance::Zigzag, CpBalance::Striped] {
            for cp in 1..=4 {
                let seq = 8 * cp;
                let lay = |r| CpLayout {
                    cp,
                    rank: r,
                    balance,
                };
                let len = lay(0).local_len(seq);
                for i in 0..cp {
                    for j in 0..cp {
                        let (qp, kp) = (lay(i).part(seq), lay(j).part(seq));
                        let (qpos, kpos) = (qp.positions(len), kp.positions(len));
                        let mut seen = vec![vec![0; len]; len];
                        for c in block_calls(qp, kp, len) {
                            for (a, qi) in c.q_rows.clone().enumerate() {
                                let first = c.first_key(doc_start(qpos[qi]));
                                for (b, kj) in c.k_rows.clone().enumerate() {
                                    let key = c.k_start + b;
                                    if key <= c.q_start + a && (opens.is_none() || first <= key) {
                                        seen[qi][kj] += 1;
                                    }
                                }
                            }
                        }
                        for qi in 0..len {
                            for kj in 0..len {
                                let want = usize::from(
                                    kpos[kj] <= qpos[qi] && doc_start(qpos[qi]) <= kpos[kj],
                                );
                                assert_eq!(
                                    seen[qi][kj], want,
                                    "{balance:?} cp={cp} docs {opens:?} q rank {i} row {qi}, k rank {j} row {kj}"
                                );
                            }
                        }
                    }
                }
                // Every position held by exactly one rank.
                let mut all: Vec<usize> = (0..cp)
                    .flat_map(|r| lay(r).part(seq).positions(len))
                    .collect();
                all.sort_unstable();
                assert_eq!(all, (0..seq).collect::<Vec<_>>(), "{balance:?} cp={cp}");
            }
        }
    }

    #[test]
    fn sequences_that_do_not_split_are_errors() {
        let l = CpLayout {
            cp: 3,
            rank: 0,
            balance: CpBalance::Zigzag,
        };
        let e = l.check(9).unwrap_err().to_string();
        assert!(e.contains("zigzag needs seq_len divisible by 2·cp"), "{e}");
        assert!(l.check(12).is_ok());
        let s = CpLayout {
            balance: CpBalance::Striped,
            ..l
        };
        assert!(s.check(9).is_ok());
        assert!(s.check(10).is_err());
    }

    #[test]
    fn slice_takes_each_sequences_tokens() {
        let l = CpLayout {
            cp: 2,
            rank: 1,
            balance: CpBalance::Zigzag,
        };
        // 2 sequences of 8 tokens, width 1: chunks of 2; rank 1 holds chunks 1 and 2.
        let full: Vec<u32> = (0..16).collect();
        assert_eq!(l.slice(&full, 2, 8, 1), vec![2, 3, 4, 5, 10, 11, 12, 13]);
    }
}
