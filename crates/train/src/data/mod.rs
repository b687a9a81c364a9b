//! Data: the built-in corpus, tokenizers, token files, corpus inputs, shard folders, and
//! deterministic sampling.
pub mod corpus;
pub mod dataset;
pub mod prepare;
pub mod shards;
pub mod sources;
pub mod tokenizer;
pub mod tokfile;

pub use dataset::{Batch, Dataset, Sampler, TokenSplit, WindowAt};
pub use tokenizer::Tokenizer;
