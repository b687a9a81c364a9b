//! Vocabulary-parallel token embedding: rank `r` owns table rows `[r·n, (r+1)·n)`,
//! `n = ⌈V/tp⌉` (rows past `V` are padding no id reaches). Forward: every rank looks up all tokens in its rows (zeros for ids
//! it does not own), then `g` sums the partial outputs (all-reduce; reduce-scatter to the local
//! tokens under sequence parallelism). Backward: `g*` (identity; all-gather under sp), then
//! each rank scatter-adds the rows it owns: no further communication.

use model::layers::block::RegionHooks;
use model::{ModelError, Result};
use tensor::embedding::{embedding_backward_shard, embedding_forward_shard};

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

    /// `ids [tokens]`, `table` the local `[V/tp, dim]` rows -> `x [tokens (local under sp), dim]`.
    pub fn forward(&self, table: &[f32], ids: &[u32]) -> Result<Vec<f32>> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.vocab) {
            return Err(ModelError::InvalidBatch(format!(
                "token id {bad} out of range for vocab_size {}",
                self.vocab
            )));
        }
        let mut x = vec![0.0; ids.len() * self.dim];
        embedding_forward_shard(ids, table, self.dim, self.start(), &mut x)?;
        self.region.exit_forward(x)
    }

    /// Accumulates the owned rows' gradient into `g_table` from `dx` (local tokens under sp).
    pub fn backward(&self, g_table: &mut [f32], ids: &[u32], dx: Vec<f32>) -> Result<()> {
        let dx = self.region.exit_backward(dx)?;
        embedding_backward_shard(ids, &dx, self.dim, self.start(), g_table)?;
        Ok(())
    }
}
