//! Tokenizers: the default byte-level tokenizer (ids are the UTF-8 bytes, vocabulary 256) and
//! Hugging Face `tokenizer.json` files through the `tokenizers` crate, plus BPE training.
use crate::error::{Result, TrainError};
use std::path::Path;

/// Text ⇄ token ids.
pub enum Tokenizer {
    /// Each UTF-8 byte is one token; decoding is lossless for any byte sequence that is UTF-8.
    Byte,
    /// A Hugging Face tokenizer loaded from `tokenizer.json`.
    Hf(Box<tokenizers::Tokenizer>),
}

fn tk_err(e: impl std::fmt::Display) -> TrainError {
    TrainError::Tokenizer(e.to_string())
}

impl Tokenizer {
    /// `byte`, or a path to a `tokenizer.json`.
    pub fn from_spec(spec: &str) -> Result<Self> {
        if spec == "byte" || spec.is_empty() {
            return Ok(Self::Byte);
        }
        let path = Path::new(spec);
        if !path.exists() {
            return Err(TrainError::Tokenizer(format!(
                "tokenizer file {spec} does not exist"
            )));
        }
        let tk = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| TrainError::Tokenizer(format!("loading {spec}: {e}")))?;
        Ok(Self::Hf(Box::new(tk)))
    }

    pub fn vocab_size(&self) -> usize {
        match self {
            Self::Byte => 256,
            Self::Hf(t) => t.get_vocab_size(true),
        }
    }

    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Self::Byte => Ok(text.bytes().map(u32::from).collect()),
            Self::Hf(t) => Ok(t.encode(text, false).map_err(tk_err)?.get_ids().to_vec()),
        }
    }

    /// Decodes ids; bytes that are not valid UTF-8 become U+FFFD (a sample can stop mid-character).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            Self::Byte => {
                let bytes = ids
                    .iter()
                    .map(|&i| u8::try_from(i).map_err(|_| tk_err(format!("id {i} is not a byte"))))
                    .collect::<Result<Vec<u8>>>()?;
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Self::Hf(t) => t.decode(ids, false).map_err(tk_err),
        }
    }
}

/// Trains a byte-level BPE tokenizer (GPT-2 style: byte-level pre-tokenizer and decoder, so
/// every string round-trips) on `files` with a target vocabulary of `vocab_size`.
pub fn train_bpe(files: &[String], vocab_size: usize) -> Result<tokenizers::Tokenizer> {
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::{
        DecoderWrapper, NormalizerWrapper, PostProcessorWrapper, PreTokenizerWrapper,
        TokenizerBuilder,
    };
    if vocab_size < 256 + 1 {
        return Err(TrainError::Tokenizer(format!(
            "BPE vocab size {vocab_size} must exceed the 256-symbol byte alphabet"
        )));
    }
    for f in files {
        if !Path::new(f).is_file() {
            return Err(TrainError::Tokenizer(format!(
                "text file {f} does not exist"
            )));
        }
    }
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab_size)
        .min_frequency(2)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tk = TokenizerBuilder::<
        BPE,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >::new()
    .with_model(BPE::default())
    .with_normalizer(None)
    .with_pre_tokenizer(Some(ByteLevel::new(false, true, true).into()))
    .with_post_processor(None)
    .with_decoder(Some(ByteLevel::default().into()))
    .build()
    .map_err(tk_err)?;
    tk.train_from_files(&mut trainer, files.to_vec())
        .map_err(tk_err)?;
    Ok(tokenizers::Tokenizer::from(tk))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_round_trip() {
        let t = Tokenizer::Byte;
        let s = "héllo, wörld ✓\n";
        let ids = t.encode(s).unwrap();
        assert_eq!(ids.len(), s.len());
        assert_eq!(t.decode(&ids).unwrap(), s);
        assert!(t.decode(&[300]).is_err());
    }

    #[test]
    fn bpe_train_and_round_trip() {
        let dir = std::env::temp_dir().join(format!("xtrain-bpe-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("text.txt");
        std::fs::write(&file, crate::data::corpus::generate(3, 60_000)).unwrap();
        let tk = train_bpe(&[file.to_string_lossy().into_owned()], 400).unwrap();
        let json = dir.join("tokenizer.json");
        tk.save(&json, false).unwrap();
        let t = Tokenizer::from_spec(json.to_str().unwrap()).unwrap();
        assert!(t.vocab_size() > 256 && t.vocab_size() <= 400);
        let s = "the quick robot finds 7 apples; Ünïcode too!";
        let ids = t.encode(s).unwrap();
        assert!(ids.len() < s.len(), "merges shorten text");
        assert_eq!(t.decode(&ids).unwrap(), s);
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(Tokenizer::from_spec("/nonexistent/tokenizer.json").is_err());
        assert!(train_bpe(&["/nonexistent.txt".into()], 400).is_err());
    }
}
