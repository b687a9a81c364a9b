//! Vocabulary-parallel token embedding: rank `r` owns table rows `[r·n, (r+1)·n)`,
//! `n = ⌈V/tp⌉` (rows past `V` are padding no id reaches). Forward: every rank looks up all tokens in its rows (zeros for ids
//! it does not own), then `g` sums the partial outputs (all-reduce; reduce-scatter to the local
//! tokens under sequence parallelism). Backward: `g*` (identity; all-gather under sp), then
//! each rank scatter-adds the rows it owns: no further communication.

use model::layers::block::RegionHooks;
use model::layers::{Buf, BufMut, BufRef};
use model::{ModelError, Result};

use super::region::TpRegion;

#[derive(Debug, Clone)]
pub struct VocabParallelEmbedding {
    /// Full vocabulary size (ids must be below it).
    pub vocab: usize,
    /// Table rows per rank, `⌈vocab/tp⌉`.
    pub rows: usize,
    pub dim: usize,
    pub region: TpRegion,
}

impl VocabParallelEmbedding {
    fn start(&self) -> usize {
        self.region.rank() * self.rows
    }

    /// `ids [tokens]`, `table` the local `[V/tp, dim]` rows -> `x [tokens (local under sp), dim]`
    /// on the table's device (the partial outputs summed through host memory).
    pub fn forward(&self, table: BufRef<'_>, ids: &[u32]) -> Result<Buf> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.vocab) {
            return Err(ModelError::InvalidBatch(format!(
                "token id {bad} out of range for vocab_size {}",
                self.vocab
            )));
        }
        let x = tensor::ops::embedding_forward(ids, table, self.dim, Some(self.start()))?;
        self.region.exit_forward(x)
    }

    /// Accumulates the owned rows' gradient into `g_table` from `dx` (local tokens under sp).
    pub fn backward(&self, g_table: BufMut<'_>, ids: &[u32], dx: Buf) -> Result<()> {
        let dx = self.region.exit_backward(dx)?;
        tensor::ops::embedding_backward(ids, dx.r(), self.dim, Some(self.start()), g_table)?;
        Ok(())
    }
}
