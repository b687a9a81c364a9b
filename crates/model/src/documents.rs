//! Document boundaries of a packed micro-batch: which tokens of each row belong to the same
//! document, so that attention never crosses a boundary (block-causal attention) and, when
//! asked, RoPE positions restart at every document's first token.
//!
//! A row of `seq` tokens is cut into contiguous documents; the mask is carried as
//! `start[b, p]`, the position (within row `b`) of the first token of the document holding
//! position `p`. Query `p` sees key `j` iff `start[b, p] <= j <= p`. Contiguity is what makes
//! the per-query interval exact, and it is what [`Documents::new`] checks:
//! `start[b, p] ∈ {p, start[b, p − 1]}` (a token opens a document or continues its
//! predecessor's) and `start[b, 0] = 0`.
//!
//! The starts are over the whole sequence (global positions), so a context-parallel rank, which
//! holds only some positions, finds the start of any query it holds and tests keys that arrive
//! from other ranks by their global positions.

use crate::error::{ModelError, Result};

/// Per-token document starts of a `[batch, seq]` micro-batch (module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Documents {
    batch: usize,
    seq: usize,
    start: Vec<usize>,
    /// RoPE position of token `p` is `p − start[b, p]` (its offset in its document) instead of
    /// `p`: then every document of a packed row is computed exactly as if it were alone.
    restart_positions: bool,
}

impl Documents {
    /// From `start` (`[batch, seq]`, module doc), checked.
    pub fn new(
        batch: usize,
        seq: usize,
        start: Vec<usize>,
        restart_positions: bool,
    ) -> Result<Self> {
        let bad = |why: String| Err(ModelError::InvalidBatch(format!("document starts: {why}")));
        if start.len() != batch * seq {
            return bad(format!(
                "{} entries for a batch of {batch} × {seq} tokens",
                start.len()
            ));
        }
        for (b, row) in start.chunks(seq.max(1)).enumerate() {
            for (p, &s) in row.iter().enumerate() {
                let prev = if p == 0 { 0 } else { row[p - 1] };
                if s != p && s != prev {
                    return bad(format!(
                        "row {b} position {p} starts at {s}: a token either opens a document (its own position) or continues the previous token's ({prev})"
                    ));
                }
            }
        }
        Ok(Documents {
            batch,
            seq,
            start,
            restart_positions,
        })
    }

    /// From the tokens that open a document (`opens(b, p)`; position 0 of a row always opens
    /// one: a window cut from a longer stream begins inside some document).
    pub fn from_openings(
        batch: usize,
        seq: usize,
        restart_positions: bool,
        opens: impl Fn(usize, usize) -> bool,
    ) -> Self {
        let mut start = Vec::with_capacity(batch * seq);
        for b in 0..batch {
            let mut cur = 0;
            for p in 0..seq {
                if p > 0 && opens(b, p) {
                    cur = p;
                }
                start.push(cur);
            }
        }
        Documents {
            batch,
            seq,
            start,
            restart_positions,
        }
    }

    pub fn batch(&self) -> usize {
        self.batch
    }

    /// Tokens per row (the whole sequence, also under context parallelism).
    pub fn seq(&self) -> usize {
        self.seq
    }

    pub fn restart_positions(&self) -> bool {
        self.restart_positions
    }

    /// `start[b, p]`: the first position of the document holding position `p` of row `b`.
    #[inline]
    pub fn start(&self, b: usize, p: usize) -> usize {
        self.start[b * self.seq + p]
    }

    /// All starts, `[batch, seq]`.
    pub fn starts(&self) -> &[usize] {
        &self.start
    }

    /// The RoPE position of position `p` of row `b`.
    #[inline]
    pub fn position(&self, b: usize, p: usize) -> usize {
        if self.restart_positions {
            p - self.start(b, p)
        } else {
            p
        }
    }

    /// The document of each token as `(row, start, length)` runs, in order.
    pub fn spans(&self) -> Vec<(usize, usize, usize)> {
        let mut v = Vec::new();
        for b in 0..self.batch {
            let mut p = 0;
            while p < self.seq {
                let s = self.start(b, p);
                let mut e = p + 1;
                while e < self.seq && self.start(b, e) == s {
                    e += 1;
                }
                v.push((b, p, e - p));
                p = e;
            }
        }
        v
    }

    /// Checks that these documents describe a `[batch, seq]` micro-batch.
    pub fn check(&self, batch: usize, seq: usize) -> Result<()> {
        if (self.batch, self.seq) != (batch, seq) {
            return Err(ModelError::InvalidBatch(format!(
                "document starts for a batch of {} × {} tokens, but the batch is {batch} × {seq}",
                self.batch, self.seq
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openings_starts_spans_and_positions() {
        let d = Documents::from_openings(2, 5, true, |b, p| (b == 0 && p == 3) || p == 0);
        assert_eq!(d.starts(), &[0, 0, 0, 3, 3, 0, 0, 0, 0, 0]);
        assert_eq!(d.spans(), vec![(0, 0, 3), (0, 3, 2), (1, 0, 5)]);
        assert_eq!(d.position(0, 4), 1);
        assert_eq!(d.position(1, 4), 4);
        assert_eq!(Documents::new(2, 5, d.starts().to_vec(), true).unwrap(), d);
    }

    #[test]
    fn inconsistent_starts_are_errors() {
        let e = Documents::new(1, 4, vec![0, 0, 1, 1], false).unwrap_err();
        assert!(e.to_string().contains("position 2 starts at 1"), "{e}");
        assert!(Documents::new(1, 4, vec![0, 0, 0], false).is_err());
        let d = Documents::new(1, 4, vec![0, 1, 1, 3], false).unwrap();
        assert!(d.check(1, 4).is_ok() && d.check(2, 4).is_err());
    }
}
