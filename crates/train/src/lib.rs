//! `train`: the trainer loop, optimizer schedule, mixed precision, data and tokenizers,
//! checkpoints and metrics.
