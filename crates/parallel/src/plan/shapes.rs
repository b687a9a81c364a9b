//! Named model shapes the planner knows besides the trainer's presets and Hugging Face
//! `config.json` files: published architectures, as decoder configs of this engine (Llama
//! blocks: RMSNorm, SwiGLU, RoPE, untied head).
//!
//! GPT-3 175B (Brown et al. 2020: h = 12288, 96 layers, 96 heads, vocabulary 51200) is written
//! as a SwiGLU block of the same size: its GeLU MLP `h → 4h → h` holds `8h²` weights, and a
//! SwiGLU MLP of width `8h/3 = 32768` holds `3·h·8h/3 = 8h²` too, so parameters and FLOPs per
//! token equal GPT-3's (12h² per layer).
use model::ModelConfig;

/// The names [`named`] knows.
pub const NAMES: [&str; 6] = [
    "llama2-7b",
    "llama3-8b",
    "llama3-70b",
    "llama3-405b",
    "mixtral-8x7b",
    "gpt3-175b",
];

/// The shape called `name`, or `None`.
pub fn named(name: &str) -> Option<ModelConfig> {
    let llama = ModelConfig::llama;
    let mut cfg = match name {
        "llama2-7b" => llama(32000, 4096, 11008, 32, 32, 32),
        "llama3-8b" => llama(128_256, 4096, 14336, 32, 32, 8),
        "llama3-70b" => llama(128_256, 8192, 28672, 80, 64, 8),
        "llama3-405b" => llama(128_256, 16384, 53248, 126, 128, 8),
        "mixtral-8x7b" => llama(32000, 4096, 14336, 32, 32, 8).with_experts(8, 2),
        "gpt3-175b" => llama(51200, 12288, 32768, 96, 96, 96),
        _ => return None,
    };
    cfg.max_position_embeddings = 131_072;
    Some(cfg)
}

/// Parameters of the whole model (every expert counted).
pub fn num_params(cfg: &ModelConfig) -> usize {
    model::ParamLayout::new(cfg).total()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_parameter_counts() {
        let billions = |n: &str| num_params(&named(n).unwrap()) as f64 / 1e9;
        // Published sizes: Llama 3 8.03B / 70.6B / 405.9B, Mixtral 46.7B, GPT-3 175B.
        for (name, want) in [
            ("llama2-7b", 6.74),
            ("llama3-8b", 8.03),
            ("llama3-70b", 70.55),
            ("llama3-405b", 405.85),
            ("mixtral-8x7b", 46.70),
            ("gpt3-175b", 175.2),
        ] {
            let got = billions(name);
            assert!((got - want).abs() / want < 0.005, "{name}: {got:.2}B");
        }
        assert!(named("gpt-5").is_none());
    }
}
