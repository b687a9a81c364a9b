//! Text generation from a trained model: temperature and top-k sampling with a seeded RNG.
//!
//! Each new token reruns the forward pass over the last `context` tokens (no KV cache: the
//! trainer's models are small and this keeps one code path, the training forward).
use crate::data::Tokenizer;
use crate::error::{Result, TrainError};
use crate::rng::Rng;
use model::Model;
use tensor::buf::BufRef;

/// Sampling settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SampleOptions {
    pub max_new_tokens: usize,
    /// 0 means greedy (argmax).
    pub temperature: f64,
    /// Keep only the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    pub seed: u64,
    /// Longest context fed to the model (the training sequence length).
    pub context: usize,
}

/// Picks the next token from `logits` (one row).
pub fn sample_token(logits: &[f32], opts: &SampleOptions, rng: &mut Rng) -> u32 {
    let argmax = || {
        logits
            .iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &x)| if x > b.1 { (i, x) } else { b },
            )
            .0 as u32
    };
    if opts.temperature <= 0.0 {
        return argmax();
    }
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    if opts.top_k > 0 && opts.top_k < logits.len() {
        // Stable sort by descending logit: ties keep index order, so sampling is deterministic.
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        idx.truncate(opts.top_k);
    }
    let max = idx
        .iter()
        .map(|&i| logits[i])
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let weights: Vec<f64> = idx
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / opts.temperature).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut u = rng.uniform() * total;
    for (k, w) in weights.iter().enumerate() {
        if u < *w {
            return idx[k] as u32;
        }
        u -= w;
    }
    idx[idx.len() - 1] as u32
}

/// Continues `prompt` by up to `max_new_tokens` tokens; returns the decoded continuation.
/// `params` may live on the host or a GPU (the model runs where they are).
pub fn generate(
    model: &Model,
    params: BufRef<'_>,
    tokenizer: &Tokenizer,
    prompt: &str,
    opts: &SampleOptions,
) -> Result<String> {
    let mut ids = tokenizer.encode(prompt)?;
    if ids.is_empty() {
        return Err(TrainError::Config("the prompt encodes to no tokens".into()));
    }
    let vocab = model.cfg.vocab_size;
    if let Some(&bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(TrainError::Data(format!(
            "prompt token {bad} is >= model vocab size {vocab}"
        )));
    }
    let start = ids.len();
    let mut rng = Rng::new(opts.seed);
    for _ in 0..opts.max_new_tokens {
        let ctx = &ids[ids.len().saturating_sub(opts.context.max(1))..];
        // One hand-over to the kernel pool per forward, not one per kernel (`threads::install`).
        let logits = tensor::threads::install(|| model.logits(params, ctx, 1, ctx.len()))
            .map_err(|e| TrainError::Model(e.to_string()))?;
        let last = &logits[(ctx.len() - 1) * vocab..ctx.len() * vocab];
        ids.push(sample_token(last, opts, &mut rng));
    }
    tokenizer.decode(&ids[start..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_top_k_and_temperature() {
        let logits = [0.0f32, 5.0, 1.0, 4.9];
        let mut rng = Rng::new(1);
        let o = SampleOptions {
            max_new_tokens: 1,
            temperature: 0.0,
            top_k: 0,
            seed: 1,
            context: 8,
        };
        assert_eq!(sample_token(&logits, &o, &mut rng), 1);
        let o = SampleOptions {
            temperature: 1.0,
            top_k: 2,
            ..o
        };
        for _ in 0..100 {
            let t = sample_token(&logits, &o, &mut rng);
            assert!(t == 1 || t == 3, "top-2 only");
        }
        // High temperature reaches every token.
        let o = SampleOptions {
            temperature: 100.0,
            top_k: 0,
            ..o
        };
        let mut seen = [false; 4];
        for _ in 0..400 {
            seen[sample_token(&logits, &o, &mut rng) as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }
}
