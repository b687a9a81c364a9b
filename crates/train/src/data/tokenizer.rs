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
            // The ids only: no offsets to track.
            Self::Hf(t) => Ok(t
                .encode_fast(text, false)
                .map_err(tk_err)?
                .get_ids()
                .to_vec()),
        }
    }

    /// The end-of-document id appended to each document of a shard folder, and the
    /// beginning-of-document id prepended where the tokenizer has one. The byte tokenizer ends
    /// documents with byte 0 (NUL, absent from text) and has no BOS. A Hugging Face tokenizer's
    /// are `eos` / `bos` when given (they must be in its vocabulary), else the first of the
    /// usual names it knows; one without an end-of-document token is an error.
    pub fn document_ids(&self, eos: Option<&str>, bos: Option<&str>) -> Result<(Option<u32>, u32)> {
        const EOS: &[&str] = &[
            "<|endoftext|>",
            "</s>",
            "<|end_of_text|>",
            "<eos>",
            "<|eos|>",
        ];
        const BOS: &[&str] = &["<s>", "<|begin_of_text|>", "<bos>", "<|bos|>"];
        match self {
            Self::Byte => {
                if eos.is_some() || bos.is_some() {
                    return Err(tk_err(
                        "the byte tokenizer ends documents with byte 0 and has no BOS: --eos and --bos need a tokenizer.json",
                    ));
                }
                Ok((None, 0))
            }
            Self::Hf(t) => {
                let named = |tok: &str| {
                    t.token_to_id(tok).ok_or_else(|| {
                        tk_err(format!(
                            "token {tok:?} is not in the tokenizer's vocabulary"
                        ))
                    })
                };
                let eos_id = match eos {
                    Some(tok) => named(tok)?,
                    None => EOS.iter().find_map(|tok| t.token_to_id(tok)).ok_or_else(|| {
                        tk_err(format!(
                            "the tokenizer has no end-of-document token (none of {EOS:?}); name one with --eos"
                        ))
                    })?,
                };
                let bos_id = match bos {
                    Some(tok) => Some(named(tok)?),
                    None => BOS.iter().find_map(|tok| t.token_to_id(tok)),
                };
                Ok((bos_id, eos_id))
            }
        }
    }

    /// One document as a shard stores it: BOS (if any), the text's ids, EOS.
    /// Allocates the result once, at its final size.
    pub fn encode_document(&self, text: &str, bos: Option<u32>, eos: u32) -> Result<Vec<u32>> {
        let assemble = |body: &mut dyn ExactSizeIterator<Item = u32>| {
            let mut ids = Vec::with_capacity(body.len() + 2);
            ids.extend(bos);
            ids.extend(body);
            ids.push(eos);
            ids
        };
        Ok(match self {
            Self::Byte => assemble(&mut text.bytes().map(u32::from)),
            Self::Hf(t) => {
                let enc = t.encode_fast(text, false).map_err(tk_err)?;
                assemble(&mut enc.get_ids().iter().copied())
            }
        })
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

/// A Hugging Face tokenizer (as [`train_bpe`] returns it).
pub type HfTokenizer = tokenizers::Tokenizer;

/// Saves `tk` as a `tokenizer.json` at `path`; returns its vocabulary size.
pub fn save_tokenizer(tk: &HfTokenizer, path: &Path) -> Result<usize> {
    tk.save(path, false)
        .map_err(|e| TrainError::Tokenizer(format!("saving {}: {e}", path.display())))?;
    Ok(tk.get_vocab_size(true))
}

/// The special token [`train_bpe`] adds: the end of a document.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// Trains a byte-level BPE tokenizer (GPT-2 style: byte-level pre-tokenizer and decoder, so
/// every string round-trips) on `files` with a target vocabulary of `vocab_size`, including
/// the special token [`END_OF_TEXT`].
pub fn train_bpe(files: &[String], vocab_size: usize) -> Result<tokenizers::Tokenizer> {
    for f in files {
        if !Path::new(f).is_file() {
            return Err(TrainError::Tokenizer(format!(
                "text file {f} does not exist"
            )));
        }
    }
    let (mut trainer, mut tk) = bpe_setup(vocab_size)?;
    tk.train_from_files(&mut trainer, files.to_vec())
        .map_err(tk_err)?;
    Ok(tokenizers::Tokenizer::from(tk))
}

/// [`train_bpe`] on a stream of documents (JSONL or Parquet corpora).
pub fn train_bpe_on<I>(documents: I, vocab_size: usize) -> Result<tokenizers::Tokenizer>
where
    I: Iterator<Item = String> + Send,
{
    let (mut trainer, mut tk) = bpe_setup(vocab_size)?;
    tk.train(&mut trainer, documents).map_err(tk_err)?;
    Ok(tokenizers::Tokenizer::from(tk))
}

type BpeTokenizer = tokenizers::TokenizerImpl<
    tokenizers::models::bpe::BPE,
    tokenizers::NormalizerWrapper,
    tokenizers::PreTokenizerWrapper,
    tokenizers::PostProcessorWrapper,
    tokenizers::DecoderWrapper,
>;

fn bpe_setup(vocab_size: usize) -> Result<(tokenizers::models::bpe::BpeTrainer, BpeTokenizer)> {
    use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::TokenizerBuilder;
    if vocab_size < 256 + 1 {
        return Err(TrainError::Tokenizer(format!(
            "BPE vocab size {vocab_size} must exceed the 256-symbol byte alphabet"
        )));
    }
    let trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab_size)
        .min_frequency(2)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        // The end-of-document token that shard folders append to every document.
        .special_tokens(vec![tokenizers::AddedToken::from(END_OF_TEXT, true)])
        .build();
    let tk = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None)
        .with_pre_tokenizer(Some(ByteLevel::new(false, true, true).into()))
        .with_post_processor(None)
        .with_decoder(Some(ByteLevel::default().into()))
        .build()
        .map_err(tk_err)?;
    Ok((trainer, tk))
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
