//! Token streams, the train/validation split, and the deterministic batch sampler.
//!
//! Sampling is stateless given `(seed, step)`: global sample `g` starts at a position drawn from
//! the random stream `(seed, g)`, so resuming needs only the step, and a data-parallel rank draws
//! exactly the samples the single-process run would have used in the same step.
use super::corpus;
use super::tokenizer::Tokenizer;
use super::tokfile::TokenFile;
use crate::config::DataConfig;
use crate::error::{IoContext, Result, TrainError};
use crate::rng::Rng;
use std::path::Path;
use std::sync::Arc;

/// Backing store of a token stream.
enum Store {
    Owned(Vec<u32>),
    Mapped(TokenFile),
}

/// A contiguous window `[start, start + len)` of a shared token store.
#[derive(Clone)]
pub struct TokenSplit {
    store: Arc<Store>,
    start: usize,
    len: usize,
}

impl TokenSplit {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn get(&self, i: usize) -> u32 {
        match &*self.store {
            Store::Owned(v) => v[self.start + i],
            Store::Mapped(f) => f.get(self.start + i),
        }
    }

    /// Copies `out.len()` tokens from position `pos`.
    pub fn copy_to(&self, pos: usize, out: &mut [u32]) {
        for (k, o) in out.iter_mut().enumerate() {
            *o = self.get(pos + k);
        }
    }
}

/// Training and validation tokens with their tokenizer's vocabulary size.
pub struct Dataset {
    pub train: TokenSplit,
    pub val: TokenSplit,
    /// Where the tokens came from, for logs.
    pub source: String,
}

impl Dataset {
    /// Builds the dataset `cfg` describes: the built-in corpus, a token file (`.tok`), or a text
    /// file tokenised with `tokenizer`. Every id is checked against `vocab_size`.
    pub fn load(
        cfg: &DataConfig,
        tokenizer: &Tokenizer,
        vocab_size: usize,
        seq_len: usize,
    ) -> Result<Self> {
        let (store, source) = if cfg.path.is_empty() {
            let text = corpus::generate(cfg.corpus_seed, cfg.corpus_bytes);
            (
                Store::Owned(tokenizer.encode(&text)?),
                format!(
                    "built-in corpus ({} bytes, seed {})",
                    text.len(),
                    cfg.corpus_seed
                ),
            )
        } else {
            let path = Path::new(&cfg.path);
            if !path.exists() {
                return Err(TrainError::Data(format!(
                    "dataset {} does not exist",
                    cfg.path
                )));
            }
            if path.extension().is_some_and(|e| e == "tok") {
                let f = TokenFile::open(path)?;
                if f.vocab_size() > vocab_size {
                    return Err(TrainError::Data(format!(
                        "token file {} was written for vocab size {} but the model has {vocab_size}",
                        cfg.path,
                        f.vocab_size()
                    )));
                }
                (Store::Mapped(f), format!("token file {}", cfg.path))
            } else {
                let text =
                    std::fs::read_to_string(path).ctx(|| format!("reading text {}", cfg.path))?;
                (
                    Store::Owned(tokenizer.encode(&text)?),
                    format!("text file {}", cfg.path),
                )
            }
        };
        Self::from_store(store, source, cfg.val_fraction, vocab_size, seq_len)
    }

    /// A dataset over in-memory ids (tests, benchmarks).
    pub fn from_ids(
        ids: Vec<u32>,
        val_fraction: f64,
        vocab_size: usize,
        seq_len: usize,
    ) -> Result<Self> {
        Self::from_store(
            Store::Owned(ids),
            "in-memory ids".into(),
            val_fraction,
            vocab_size,
            seq_len,
        )
    }

    fn from_store(
        store: Store,
        source: String,
        val_fraction: f64,
        vocab_size: usize,
        seq_len: usize,
    ) -> Result<Self> {
        let n = match &store {
            Store::Owned(v) => v.len(),
            Store::Mapped(f) => f.len(),
        };
        if n == 0 {
            return Err(TrainError::Data(format!("{source} is empty")));
        }
        let check = |pos: usize, id: u32| {
            if id as usize >= vocab_size {
                Err(TrainError::Data(format!(
                    "{source}: token id {id} at position {pos} is >= model vocab size {vocab_size}"
                )))
            } else {
                Ok(())
            }
        };
        match &store {
            Store::Owned(v) => v.iter().enumerate().try_for_each(|(p, &id)| check(p, id))?,
            Store::Mapped(f) => (0..n).try_for_each(|p| check(p, f.get(p)))?,
        }
        let n_val = if val_fraction > 0.0 {
            ((n as f64 * val_fraction) as usize).max(seq_len + 1)
        } else {
            0
        };
        let n_train = n.saturating_sub(n_val);
        // A sample is seq_len + 1 tokens (inputs plus the shifted targets).
        if n_train < seq_len + 1 || (val_fraction > 0.0 && n_val < seq_len + 1) {
            return Err(TrainError::Data(format!(
                "{source} has {n} tokens: too few for sequences of {seq_len} with a {val_fraction} validation split"
            )));
        }
        let store = Arc::new(store);
        Ok(Self {
            train: TokenSplit {
                store: store.clone(),
                start: 0,
                len: n_train,
            },
            val: TokenSplit {
                store,
                start: n_train,
                len: n_val,
            },
            source,
        })
    }
}

/// One micro-batch: `batch × seq` inputs and the next-token targets.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub batch: usize,
    pub seq: usize,
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
}

/// Which global samples a rank reads: step `s` owns global samples `s·G .. (s+1)·G` with
/// `G = dp × micro_batch × grad_accum`; accumulation step `a` of rank `r` reads
/// `s·G + a·(dp·micro_batch) + r·micro_batch + (0..micro_batch)`. The union over ranks and
/// accumulation steps is the same set whatever `dp` is, so data-parallel runs see the same data
/// as the single-process run with `grad_accum × dp` accumulation steps.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampler {
    pub seed: u64,
    pub seq_len: usize,
    pub micro_batch: usize,
    pub grad_accum: usize,
    pub dp: usize,
    pub rank: usize,
}

impl Sampler {
    pub fn global_batch(&self) -> usize {
        self.dp * self.micro_batch * self.grad_accum
    }

    /// First global sample index of `(step, accum)` on this rank.
    pub fn first_sample(&self, step: u64, accum: usize) -> u64 {
        step * self.global_batch() as u64
            + (accum * self.dp * self.micro_batch + self.rank * self.micro_batch) as u64
    }

    /// Training micro-batch `accum` of optimizer step `step`.
    pub fn train_batch(&self, data: &TokenSplit, step: u64, accum: usize) -> Batch {
        self.batch_at(data, self.seed, self.first_sample(step, accum))
    }

    /// Validation micro-batch `i`: a fixed set of windows (its own stream), so successive
    /// validations measure the same tokens.
    pub fn val_batch(&self, data: &TokenSplit, i: usize) -> Batch {
        self.batch_at(
            data,
            self.seed ^ 0xA5A5_5A5A_0F0F_F0F0,
            (i * self.micro_batch) as u64,
        )
    }

    fn batch_at(&self, data: &TokenSplit, seed: u64, first: u64) -> Batch {
        let (b, s) = (self.micro_batch, self.seq_len);
        let mut inputs = vec![0; b * s];
        let mut targets = vec![0; b * s];
        let mut window = vec![0; s + 1];
        let span = (data.len() - s) as u64; // valid starts: 0..=len-(s+1)
        for k in 0..b {
            let start = Rng::stream(seed, first + k as u64).below(span) as usize;
            data.copy_to(start, &mut window);
            inputs[k * s..(k + 1) * s].copy_from_slice(&window[..s]);
            targets[k * s..(k + 1) * s].copy_from_slice(&window[1..]);
        }
        Batch {
            batch: b,
            seq: s,
            inputs,
            targets,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data() -> Dataset {
        Dataset::from_ids((0..5000).map(|i| (i % 251) as u32).collect(), 0.1, 256, 16).unwrap()
    }

    #[test]
    fn targets_are_shifted_inputs() {
        let d = data();
        let s = Sampler {
            seed: 1,
            seq_len: 16,
            micro_batch: 3,
            grad_accum: 2,
            dp: 1,
            rank: 0,
        };
        let b = s.train_batch(&d.train, 4, 1);
        for r in 0..3 {
            assert_eq!(
                b.inputs[r * 16 + 1..(r + 1) * 16],
                b.targets[r * 16..(r + 1) * 16 - 1]
            );
        }
        assert_eq!(b, s.train_batch(&d.train, 4, 1), "deterministic");
        assert_ne!(b, s.train_batch(&d.train, 5, 1));
        assert_eq!(s.val_batch(&d.val, 0), s.val_batch(&d.val, 0));
    }

    #[test]
    fn data_parallel_ranks_cover_the_single_run() {
        let d = data();
        let single = Sampler {
            seed: 9,
            seq_len: 16,
            micro_batch: 2,
            grad_accum: 4,
            dp: 1,
            rank: 0,
        };
        let mut want: Vec<Vec<u32>> = (0..4)
            .flat_map(|a| {
                single
                    .train_batch(&d.train, 3, a)
                    .inputs
                    .chunks(16)
                    .map(<[u32]>::to_vec)
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut got = Vec::new();
        for rank in 0..2 {
            let s = Sampler {
                dp: 2,
                rank,
                grad_accum: 2,
                ..single.clone()
            };
            for a in 0..2 {
                got.extend(
                    s.train_batch(&d.train, 3, a)
                        .inputs
                        .chunks(16)
                        .map(<[u32]>::to_vec),
                );
            }
        }
        want.sort();
        got.sort();
        assert_eq!(want, got);
    }

    #[test]
    fn bad_data_is_refused() {
        assert!(Dataset::from_ids(vec![], 0.1, 256, 16)
            .err()
            .unwrap()
            .to_string()
            .contains("empty"));
        let e = Dataset::from_ids(vec![1, 2, 256, 3], 0.0, 256, 2)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("256") && e.contains("position 2"), "{e}");
        assert!(Dataset::from_ids(vec![1; 20], 0.1, 256, 16)
            .err()
            .unwrap()
            .to_string()
            .contains("too few"));
        let cfg = DataConfig {
            path: "/nonexistent/data.tok".into(),
            tokenizer: "byte".into(),
            val_fraction: 0.1,
            corpus_bytes: 0,
            corpus_seed: 0,
        };
        assert!(Dataset::load(&cfg, &Tokenizer::Byte, 256, 16)
            .err()
            .unwrap()
            .to_string()
            .contains("does not exist"));
    }
}
