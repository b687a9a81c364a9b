//! Token streams, the train/validation split, mixtures, and the deterministic batch sampler.
//!
//! Sampling is stateless given `(seed, step)`: global sample `g` draws its window from the
//! random stream `(seed, g)`, so resuming needs only the step, and a data-parallel rank draws
//! exactly the samples the single-process run would have used in the same step.
//!
//! A split is a weighted mixture of sources, each a list of segments: contiguous token ranges
//! a window of `seq_len + 1` tokens may lie in (a shard's training documents, its held-out
//! documents, or a stream's head or tail). Sample `g` picks a source by weight (only when there
//! are several), then a window start uniformly among all the source's valid starts.
//!
//! Document boundaries: a shard's segments keep its document index, so a window also gives the
//! document start of each of its input positions (the first position of the window opens a
//! document: the window may begin inside one). A batch carries them when every window has
//! them; the trainer masks attention with them under `data.document_mask`. Windows still
//! cross boundaries (packing), and targets stay the next token of the stream: a document's
//! last token (its EOS) predicts the next document's first token from its own document only.
use super::corpus;
use super::shards::{DocIndex, ShardSet};
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

impl Store {
    fn len(&self) -> usize {
        match self {
            Store::Owned(v) => v.len(),
            Store::Mapped(f) => f.len(),
        }
    }

    fn get(&self, i: usize) -> u32 {
        match self {
            Store::Owned(v) => v[i],
            Store::Mapped(f) => f.get(i),
        }
    }
}

/// A contiguous range `[start, start + len)` of a store, with the store's document starts when
/// it has them (a shard).
#[derive(Clone)]
struct Segment {
    store: Arc<Store>,
    start: usize,
    len: usize,
    docs: Option<Arc<DocIndex>>,
}

/// One source of a split: its segments and the running count of window starts.
#[derive(Clone)]
struct Source {
    segments: Vec<Segment>,
    /// `starts[i]`: valid window starts in segments `0..=i`.
    starts: Vec<u64>,
}

impl Source {
    fn new(segments: Vec<Segment>, window: usize) -> Self {
        let mut acc = 0u64;
        let starts = segments
            .iter()
            .map(|s| {
                acc += (s.len + 1).saturating_sub(window) as u64;
                acc
            })
            .collect();
        Self { segments, starts }
    }

    fn windows(&self) -> u64 {
        self.starts.last().copied().unwrap_or(0)
    }

    /// The segment and offset of window start number `k` (`k < windows()`).
    fn locate(&self, k: u64) -> (&Segment, usize) {
        let i = self.starts.partition_point(|&c| c <= k);
        let before = if i == 0 { 0 } else { self.starts[i - 1] };
        (&self.segments[i], (k - before) as usize)
    }
}

/// The windows one split (training or validation) draws from: a weighted mixture of sources.
#[derive(Clone)]
pub struct TokenSplit {
    sources: Vec<Source>,
    /// Running sums of the normalised source weights (the last is 1).
    cum_weights: Vec<f64>,
    /// Tokens per window: `seq_len + 1`.
    window: usize,
}

impl TokenSplit {
    /// Tokens in the split.
    pub fn len(&self) -> usize {
        self.sources
            .iter()
            .flat_map(|s| &s.segments)
            .map(|s| s.len)
            .sum()
    }

    pub fn is_empty(&self) -> bool {
        self.windows() == 0
    }

    /// Distinct windows the split can give.
    pub fn windows(&self) -> u64 {
        self.sources.iter().map(Source::windows).sum()
    }

    /// Tokens per window (`seq_len + 1`).
    pub fn window(&self) -> usize {
        self.window
    }

    /// Where global sample `g` of stream `seed` lies: its source, its token store and its
    /// first token there.
    pub fn locate(&self, seed: u64, g: u64) -> WindowAt {
        let (source, seg, start) = self.pick(seed, g);
        WindowAt {
            source,
            store: Arc::as_ptr(&seg.store) as usize,
            start,
        }
    }

    fn pick(&self, seed: u64, g: u64) -> (usize, &Segment, usize) {
        let mut r = Rng::stream(seed, g);
        // One source draws only its position, so a single stream samples as it always has.
        let source = if self.sources.len() == 1 {
            0
        } else {
            let u = r.uniform();
            self.cum_weights
                .iter()
                .position(|&c| u < c)
                .unwrap_or(self.sources.len() - 1)
        };
        let src = &self.sources[source];
        let (seg, off) = src.locate(r.below(src.windows()));
        (source, seg, seg.start + off)
    }

    /// Copies the window of global sample `g` of stream `seed` into `out` (`window()` tokens)
    /// and, when its store has document boundaries, writes into `starts` (one per input
    /// position, `window() − 1`) the window position where each input's document starts;
    /// returns whether it did.
    fn copy_window(&self, seed: u64, g: u64, out: &mut [u32], starts: &mut [usize]) -> bool {
        let (_, seg, start) = self.pick(seed, g);
        for (k, o) in out.iter_mut().enumerate() {
            *o = seg.store.get(start + k);
        }
        let Some(docs) = &seg.docs else {
            return false;
        };
        // Documents opening inside the window: those starting after its first token.
        let mut next = docs.starts_up_to(start as u64);
        let mut cur = 0;
        for (p, s) in starts.iter_mut().enumerate() {
            if next < docs.len() && docs.start(next) == (start + p) as u64 {
                cur = p;
                next += 1;
            }
            *s = cur;
        }
        true
    }
}

/// Where a sampled window lies (see [`TokenSplit::locate`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WindowAt {
    pub source: usize,
    /// Identity of the token store (a shard, a token file, an in-memory stream).
    pub store: usize,
    /// First token of the window in the store.
    pub start: usize,
}

/// Training and validation tokens.
pub struct Dataset {
    pub train: TokenSplit,
    pub val: TokenSplit,
    /// Where the tokens came from, for logs.
    pub source: String,
}

/// The train and validation segments of one source, before weighting.
struct Loaded {
    train: Vec<Segment>,
    val: Vec<Segment>,
    source: String,
}

impl Dataset {
    /// Builds the dataset `cfg` describes: the built-in corpus, a shard folder, a token file
    /// (`.tok`) or a text file tokenised with `tokenizer`, or a mixture of such (`data.mix`).
    pub fn load(
        cfg: &DataConfig,
        tokenizer: &Tokenizer,
        vocab_size: usize,
        seq_len: usize,
    ) -> Result<Self> {
        let window = seq_len + 1;
        let parts: Vec<(Loaded, f64)> = if !cfg.mix.is_empty() {
            if !cfg.path.is_empty() {
                return Err(TrainError::Data(
                    "set data.path or data.mix, not both".into(),
                ));
            }
            cfg.mix
                .iter()
                .map(|m| {
                    if !(m.weight.is_finite() && m.weight > 0.0) {
                        return Err(TrainError::Data(format!(
                            "data.mix: {} has weight {}: weights must be positive",
                            m.path, m.weight
                        )));
                    }
                    Ok((
                        load_path(&m.path, cfg.val_fraction, tokenizer, vocab_size, window)?,
                        m.weight,
                    ))
                })
                .collect::<Result<_>>()?
        } else if cfg.path.is_empty() {
            let text = corpus::generate(cfg.corpus_seed, cfg.corpus_bytes);
            let source = format!(
                "built-in corpus ({} bytes, seed {})",
                text.len(),
                cfg.corpus_seed
            );
            let store = Store::Owned(tokenizer.encode(&text)?);
            vec![(
                stream(store, source, cfg.val_fraction, vocab_size, window)?,
                1.0,
            )]
        } else {
            vec![(
                load_path(&cfg.path, cfg.val_fraction, tokenizer, vocab_size, window)?,
                1.0,
            )]
        };
        Self::assemble(parts, cfg.val_fraction, window)
    }

    /// A dataset over in-memory ids (tests, benchmarks).
    pub fn from_ids(
        ids: Vec<u32>,
        val_fraction: f64,
        vocab_size: usize,
        seq_len: usize,
    ) -> Result<Self> {
        let l = stream(
            Store::Owned(ids),
            "in-memory ids".into(),
            val_fraction,
            vocab_size,
            seq_len + 1,
        )?;
        Self::assemble(vec![(l, 1.0)], val_fraction, seq_len + 1)
    }

    fn assemble(parts: Vec<(Loaded, f64)>, val_fraction: f64, window: usize) -> Result<Self> {
        let total: f64 = parts.iter().map(|(_, w)| w).sum();
        let mut acc = 0.0;
        let cum_weights: Vec<f64> = parts
            .iter()
            .map(|(_, w)| {
                acc += w / total;
                acc
            })
            .collect();
        let source = if parts.len() == 1 {
            parts[0].0.source.clone()
        } else {
            let names: Vec<String> = parts
                .iter()
                .map(|(l, w)| format!("{:.3} × {}", w / total, l.source))
                .collect();
            format!("mixture of {}", names.join(" + "))
        };
        let split = |pick: fn(&Loaded) -> &Vec<Segment>| TokenSplit {
            sources: parts
                .iter()
                .map(|(l, _)| Source::new(pick(l).clone(), window))
                .collect(),
            cum_weights: cum_weights.clone(),
            window,
        };
        let (train, val) = (split(|l| &l.train), split(|l| &l.val));
        for (k, (l, _)) in parts.iter().enumerate() {
            if train.sources[k].windows() == 0 {
                return Err(TrainError::Data(format!(
                    "{} has no training window of {window} tokens (seq_len + 1) outside its validation documents",
                    l.source
                )));
            }
            if val_fraction > 0.0 && val.sources[k].windows() == 0 {
                return Err(TrainError::Data(format!(
                    "{} has no validation window of {window} tokens (seq_len + 1): too few held-out tokens for data.val_fraction {val_fraction}",
                    l.source
                )));
            }
        }
        Ok(Self { train, val, source })
    }
}

/// Loads one path: a shard folder, a `.tok` file, or a text file.
fn load_path(
    path_str: &str,
    val_fraction: f64,
    tokenizer: &Tokenizer,
    vocab_size: usize,
    window: usize,
) -> Result<Loaded> {
    let path = Path::new(path_str);
    if !path.exists() {
        return Err(TrainError::Data(format!(
            "dataset {path_str} does not exist"
        )));
    }
    if path.is_dir() {
        return shard_folder(path, val_fraction, tokenizer, vocab_size);
    }
    if path.extension().is_some_and(|e| e == "tok") {
        let f = TokenFile::open(path)?;
        if f.vocab_size() > vocab_size {
            return Err(TrainError::Data(format!(
                "token file {path_str} was written for vocab size {} but the model has {vocab_size}",
                f.vocab_size()
            )));
        }
        return stream(
            Store::Mapped(f),
            format!("token file {path_str}"),
            val_fraction,
            vocab_size,
            window,
        );
    }
    let text = std::fs::read_to_string(path).ctx(|| format!("reading text {path_str}"))?;
    stream(
        Store::Owned(tokenizer.encode(&text)?),
        format!("text file {path_str}"),
        val_fraction,
        vocab_size,
        window,
    )
}

/// A stream without document boundaries: every id is checked against the vocabulary, and the
/// tail (`val_fraction` of the tokens, at least one window) is held out.
fn stream(
    store: Store,
    source: String,
    val_fraction: f64,
    vocab_size: usize,
    window: usize,
) -> Result<Loaded> {
    let n = store.len();
    if n == 0 {
        return Err(TrainError::Data(format!("{source} is empty")));
    }
    if let Some(p) = (0..n).find(|&p| store.get(p) as usize >= vocab_size) {
        return Err(TrainError::Data(format!(
            "{source}: token id {} at position {p} is >= model vocab size {vocab_size}",
            store.get(p)
        )));
    }
    let n_val = if val_fraction > 0.0 {
        ((n as f64 * val_fraction) as usize).max(window)
    } else {
        0
    };
    let n_train = n.saturating_sub(n_val);
    // A sample is seq_len + 1 tokens (inputs plus the shifted targets).
    if n_train < window || (val_fraction > 0.0 && n_val < window) {
        return Err(TrainError::Data(format!(
            "{source} has {n} tokens: too few for sequences of {} with a {val_fraction} validation split",
            window - 1
        )));
    }
    let store = Arc::new(store);
    Ok(Loaded {
        train: vec![Segment {
            store: store.clone(),
            start: 0,
            len: n_train,
            docs: None,
        }],
        val: vec![Segment {
            store,
            start: n_train,
            len: n_val,
            docs: None,
        }],
        source,
    })
}

/// Documents of a shard of `docs` held out for validation: `ceil(val_fraction × docs)`, so every
/// shard gives some when `val_fraction > 0`, but at most `docs − 1`, so every shard trains.
pub fn held_out_documents(docs: usize, val_fraction: f64) -> usize {
    ((docs as f64 * val_fraction).ceil() as usize).min(docs.saturating_sub(1))
}

/// A shard folder: each shard's last [`held_out_documents`] documents are held out for
/// validation, the documents before them train. The ids are not scanned (that would page in
/// the whole corpus): the shard headers' vocabulary must match the tokenizer's and fit the model,
/// and the writer refused any id beyond it.
fn shard_folder(
    dir: &Path,
    val_fraction: f64,
    tokenizer: &Tokenizer,
    vocab_size: usize,
) -> Result<Loaded> {
    let set = ShardSet::open(dir)?;
    let m = &set.manifest;
    if m.vocab_size != tokenizer.vocab_size() || m.vocab_size > vocab_size {
        return Err(TrainError::Data(format!(
            "shard folder {} was tokenized with {} (vocab {}), but data.tokenizer has vocab {} and the model {vocab_size}",
            dir.display(),
            m.tokenizer,
            m.vocab_size,
            tokenizer.vocab_size()
        )));
    }
    let source = format!(
        "shard folder {} ({} documents, {} tokens in {} shards)",
        dir.display(),
        m.documents,
        m.tokens,
        m.shards.len()
    );
    let (mut train, mut val) = (Vec::new(), Vec::new());
    for shard in set.shards {
        let docs = shard.docs.len();
        let n_val = held_out_documents(docs, val_fraction);
        let n = shard.tokens.len();
        let split = if n_val == 0 {
            n
        } else {
            shard.docs.start(docs - n_val) as usize
        };
        let store = Arc::new(Store::Mapped(shard.tokens));
        let docs = Some(Arc::new(shard.docs));
        train.push(Segment {
            store: store.clone(),
            start: 0,
            len: split,
            docs: docs.clone(),
        });
        val.push(Segment {
            store,
            start: split,
            len: n - split,
            docs,
        });
    }
    Ok(Loaded { train, val, source })
}

/// One micro-batch: `batch × seq` inputs and the next-token targets.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    pub batch: usize,
    pub seq: usize,
    pub inputs: Vec<u32>,
    pub targets: Vec<u32>,
    /// `[batch, seq]`: the position in its row where each input's document starts (module
    /// doc), when every window's source records document boundaries.
    pub doc_starts: Option<Vec<usize>>,
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
        assert_eq!(
            data.window(),
            s + 1,
            "split built for another sequence length"
        );
        let mut inputs = vec![0; b * s];
        let mut targets = vec![0; b * s];
        let mut starts = vec![0; b * s];
        let mut all_docs = true;
        let mut window = vec![0; s + 1];
        for k in 0..b {
            let row = k * s..(k + 1) * s;
            all_docs &= data.copy_window(seed, first + k as u64, &mut window, &mut starts[row]);
            inputs[k * s..(k + 1) * s].copy_from_slice(&window[..s]);
            targets[k * s..(k + 1) * s].copy_from_slice(&window[1..]);
        }
        Batch {
            batch: b,
            seq: s,
            inputs,
            targets,
            doc_starts: all_docs.then_some(starts),
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
            mix: Vec::new(),
            tokenizer: "byte".into(),
            val_fraction: 0.1,
            corpus_bytes: 0,
            corpus_seed: 0,
            document_mask: false,
            document_positions: false,
        };
        assert!(Dataset::load(&cfg, &Tokenizer::Byte, 256, 16)
            .err()
            .unwrap()
            .to_string()
            .contains("does not exist"));
    }
}
