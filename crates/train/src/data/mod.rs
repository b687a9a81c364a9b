//! Data: the built-in corpus, tokenizers, token files, and deterministic sampling.
pub mod corpus;
pub mod dataset;
pub mod tokenizer;
pub mod tokfile;

pub use dataset::{Batch, Dataset, Sampler, TokenSplit};
pub use tokenizer::Tokenizer;
