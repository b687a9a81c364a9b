//! Corpora into shard folders and training on them: text, JSONL (plain, gzip, zstd) and Parquet
//! inputs give shards whose tokens and document boundaries are the documents tokenized one by
//! one; malformed inputs are errors naming the file and line or row; sampling is deterministic
//! and training windows never touch held-out documents; a short run trains on a shard folder
//! and on a mixture of two.
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use train::data::prepare::{prepare, PrepareOptions};
use train::data::shards::ShardSet;
use train::data::{sources, Dataset, Sampler, Tokenizer};
use train::run::{run, RunOptions};
use train::trainer::Trainer;
use train::RunConfig;

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("xtrain-shards-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn opts(shard_tokens: u64) -> PrepareOptions {
    PrepareOptions {
        field: "text".into(),
        shard_tokens,
        tokenizer_name: "byte".into(),
        eos: None,
        bos: None,
        progress: false,
    }
}

/// Document `k`: distinct text of varying length, some of it non-ASCII.
fn doc(k: usize) -> String {
    format!("doc {k}: {} ünï {}", "ab".repeat(k % 7), k * k)
}

fn jsonl(docs: &[String]) -> String {
    docs.iter()
        .map(|d| serde_json::json!({ "id": 1, "text": d }).to_string() + "\n")
        .collect()
}

fn write_parquet(path: &Path, docs: &[String]) {
    use parquet::data_type::{ByteArray, ByteArrayType};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    let schema = Arc::new(
        parquet::schema::parser::parse_message_type(
            "message doc { REQUIRED BYTE_ARRAY text (UTF8); }",
        )
        .unwrap(),
    );
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(parquet::basic::Compression::SNAPPY)
            .set_max_row_group_row_count(Some(4))
            .build(),
    );
    let mut w =
        SerializedFileWriter::new(std::fs::File::create(path).unwrap(), schema, props).unwrap();
    // Two row groups.
    for chunk in docs.chunks(docs.len().div_ceil(2)) {
        let mut rg = w.next_row_group().unwrap();
        let mut col = rg.next_column().unwrap().unwrap();
        let values: Vec<ByteArray> = chunk.iter().map(|d| ByteArray::from(d.as_str())).collect();
        col.typed::<ByteArrayType>()
            .write_batch(&values, None, None)
            .unwrap();
        col.close().unwrap();
        rg.close().unwrap();
    }
    w.close().unwrap();
}

/// The documents of shard folder `dir`, split by its index (each with its BOS/EOS).
fn read_documents(dir: &Path) -> Vec<Vec<u32>> {
    let set = ShardSet::open(dir).unwrap();
    let mut out = Vec::new();
    for s in &set.shards {
        let ids = s.tokens.to_vec();
        let n = s.docs.len();
        for d in 0..n {
            let a = s.docs.start(d) as usize;
            let b = if d + 1 < n {
                s.docs.start(d + 1) as usize
            } else {
                ids.len()
            };
            out.push(ids[a..b].to_vec());
        }
    }
    out
}

#[test]
fn every_format_tokenizes_into_shards() {
    let d = tmp("formats");
    let docs: Vec<String> = (0..40).map(doc).collect();
    // Text (one document per file), JSONL, JSONL.gz, JSONL.zst, Parquet, in this order.
    std::fs::write(d.join("a.txt"), &docs[0]).unwrap();
    std::fs::write(d.join("b.jsonl"), jsonl(&docs[1..10]) + "\n").unwrap();
    let mut gz = flate2::write::GzEncoder::new(
        std::fs::File::create(d.join("c.jsonl.gz")).unwrap(),
        flate2::Compression::fast(),
    );
    gz.write_all(jsonl(&docs[10..20]).as_bytes()).unwrap();
    gz.finish().unwrap();
    // Two zstd frames, as parallel compressors write.
    let mut zst = ruzstd::encoding::compress_to_vec(
        jsonl(&docs[20..25]).as_bytes(),
        ruzstd::encoding::CompressionLevel::Fastest,
    );
    zst.extend(ruzstd::encoding::compress_to_vec(
        jsonl(&docs[25..30]).as_bytes(),
        ruzstd::encoding::CompressionLevel::Fastest,
    ));
    std::fs::write(d.join("d.jsonl.zst"), zst).unwrap();
    write_parquet(&d.join("e.parquet"), &docs[30..40]);
    std::fs::write(d.join("README.md"), "not a corpus file").unwrap();

    let files = sources::expand(&[d.to_string_lossy().into_owned()]).unwrap();
    assert_eq!(files.len(), 5, "{files:?}");
    let out = d.join("shards");
    let s = prepare(&files, &Tokenizer::Byte, &out, &opts(200)).unwrap();
    let m = &s.manifest;
    let want: Vec<Vec<u32>> = docs
        .iter()
        .map(|t| {
            let mut ids = Tokenizer::Byte.encode(t).unwrap();
            ids.push(0);
            ids
        })
        .collect();
    assert_eq!(read_documents(&out), want);
    let total: usize = want.iter().map(Vec::len).sum();
    assert_eq!((m.documents, m.tokens), (40, total as u64));
    assert!(m.shards.len() >= 3, "{} shards", m.shards.len());
    assert!(m.shards.iter().all(|e| e.tokens <= 200));
    assert_eq!((m.eos_id, m.bos_id, m.vocab_size), (0, None, 256));
    assert!(s.line(&out).contains("40 documents"));
    // The output must be new.
    let e = prepare(&files, &Tokenizer::Byte, &out, &opts(200)).unwrap_err();
    assert!(e.to_string().contains("not empty"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_trained_tokenizer_adds_its_end_of_text() {
    let d = tmp("bpe");
    let docs: Vec<String> = (0..30).map(doc).collect();
    let (stream, reader) = train::data::prepare::document_stream(
        vec![{
            let p = d.join("a.jsonl");
            std::fs::write(&p, jsonl(&docs)).unwrap();
            p
        }],
        "text".into(),
    );
    let tk = train::data::tokenizer::train_bpe_on(stream, 300).unwrap();
    reader.join().unwrap().unwrap();
    let tk = Tokenizer::Hf(Box::new(tk));
    let (bos, eos) = tk.document_ids(None, None).unwrap();
    assert_eq!(bos, None);
    let out = d.join("shards");
    let mut o = opts(150);
    o.tokenizer_name = "tokenizer.json".into();
    prepare(&[d.join("a.jsonl")], &tk, &out, &o).unwrap();
    let got = read_documents(&out);
    assert_eq!(got.len(), docs.len());
    for (ids, text) in got.iter().zip(&docs) {
        assert_eq!(*ids.last().unwrap(), eos);
        assert_eq!(tk.decode(&ids[..ids.len() - 1]).unwrap(), *text);
    }
    assert!(tk.document_ids(Some("<nope>"), None).is_err());
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn malformed_inputs_name_the_file_and_line() {
    let d = tmp("bad");
    let run = |name: &str, bytes: &[u8], field: &str| -> String {
        let p = d.join(name);
        std::fs::write(&p, bytes).unwrap();
        let out = d.join(format!("out-{name}"));
        let mut o = opts(100);
        o.field = field.into();
        prepare(&[p], &Tokenizer::Byte, &out, &o)
            .unwrap_err()
            .to_string()
    };
    let e = run("a.jsonl", b"{\"text\": \"ok\"}\n{\"text\": \"cut\n", "text");
    assert!(
        e.contains("a.jsonl:2") && e.contains("not a JSON object"),
        "{e}"
    );
    let e = run(
        "b.jsonl",
        b"{\"text\": \"ok\"}\n\n{\"body\": \"x\"}\n",
        "text",
    );
    assert!(
        e.contains("b.jsonl:3") && e.contains("no field \"text\""),
        "{e}"
    );
    let e = run("c.jsonl", b"{\"text\": 7}\n", "text");
    assert!(e.contains("c.jsonl:1") && e.contains("not a string"), "{e}");
    let e = run("d.parquet", b"PAR1 this is not parquet PAR1", "text");
    assert!(e.contains("d.parquet") && e.contains("Parquet"), "{e}");
    // zstd-compressed (written by pyarrow: `pq.write_table(pa.table({"text": ["hello world",
    // "second doc"]}), path, compression="zstd")`); the C codec is not built: refused, saying
    // which codecs are read.
    let zstd = include_bytes!("../../../../tests/data/parquet/zstd.parquet");
    let e = run("z.parquet", zstd, "text");
    assert!(
        e.contains("z.parquet") && e.contains("zstd") && e.contains("snappy"),
        "{e}"
    );
    let p = d.join("e.parquet");
    write_parquet(&p, &["x".to_string(), "y".to_string()]);
    let e = run("e.parquet", &std::fs::read(&p).unwrap(), "body");
    assert!(e.contains("no column \"body\""), "{e}");
    let e = run("f.jsonl.gz", b"not gzip at all", "text");
    assert!(e.contains("f.jsonl.gz"), "{e}");
    let e = run("g.jsonl", b"\n{\"text\": \"\"}\n", "text");
    assert!(e.contains("no documents"), "{e}");
    let e = sources::expand(&[d.join("*.nothing").to_string_lossy().into_owned()]).unwrap_err();
    assert!(e.to_string().contains("matches no file"), "{e}");
    // A folder without a manifest is not a dataset.
    let e = Dataset::load(
        &folder_cfg(&d.to_string_lossy(), 0.1),
        &Tokenizer::Byte,
        256,
        16,
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("index.json"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}

fn folder_cfg(path: &str, val_fraction: f64) -> train::config::DataConfig {
    let mut c = RunConfig::resolve("tiny", None, &[]).unwrap().data;
    c.path = path.into();
    c.val_fraction = val_fraction;
    c
}

/// A shard folder whose document `k` is byte `b'A' + k` repeated about `len` times (then EOS
/// 0), so a window's bytes tell which documents it read.
fn marked_corpus(dir: &Path, docs: usize, len: usize, shard_tokens: u64) -> PathBuf {
    let p = dir.join("docs.jsonl");
    let texts: Vec<String> = (0..docs)
        .map(|k| {
            char::from(b'A' + k as u8)
                .to_string()
                .repeat(len + 7 * (k % 5))
        })
        .collect();
    std::fs::write(&p, jsonl(&texts)).unwrap();
    let out = dir.join("shards");
    prepare(&[p], &Tokenizer::Byte, &out, &opts(shard_tokens)).unwrap();
    out
}

#[test]
fn sampling_is_deterministic_and_never_trains_on_held_out_documents() {
    let d = tmp("split");
    let out = marked_corpus(&d, 40, 20, 160);
    let set = ShardSet::open(&out).unwrap();
    assert!(set.shards.len() >= 4);
    // Held out: the last ceil(0.25 · n) documents of each shard (at most n − 1).
    let mut held = std::collections::HashSet::new();
    for s in &set.shards {
        let n = s.docs.len();
        let n_val = ((n as f64 * 0.25).ceil() as usize).min(n - 1);
        for k in n - n_val..n {
            held.insert(s.tokens.get(s.docs.start(k) as usize));
        }
    }
    assert!(!held.is_empty());
    let seq = 8;
    let data = Dataset::load(
        &folder_cfg(&out.to_string_lossy(), 0.25),
        &Tokenizer::Byte,
        256,
        seq,
    )
    .unwrap();
    let sampler = |rank| Sampler {
        seed: 3,
        seq_len: seq,
        micro_batch: 4,
        grad_accum: 2,
        dp: 2,
        rank,
    };
    let (mut train_seen, mut val_seen) = (Vec::new(), Vec::new());
    for step in 0..50 {
        for rank in 0..2 {
            for a in 0..2 {
                let b = sampler(rank).train_batch(&data.train, step, a);
                assert_eq!(b, sampler(rank).train_batch(&data.train, step, a));
                train_seen.extend(b.inputs.iter().chain(&b.targets).copied());
            }
        }
    }
    for i in 0..50 {
        let b = sampler(0).val_batch(&data.val, i);
        val_seen.extend(b.inputs.iter().chain(&b.targets).copied());
    }
    let marks = |ids: &[u32]| -> std::collections::HashSet<u32> {
        ids.iter().copied().filter(|&t| t != 0).collect()
    };
    let (train_marks, val_marks) = (marks(&train_seen), marks(&val_seen));
    assert!(
        train_marks.is_disjoint(&held),
        "training read held-out documents"
    );
    assert!(val_marks.is_subset(&held) && !val_marks.is_empty());
    // Layout independence: rank 1's windows at dp 2 are global samples 4..8 of the step.
    let single = Sampler {
        dp: 1,
        rank: 0,
        micro_batch: 4,
        grad_accum: 4,
        ..sampler(0)
    };
    assert_eq!(
        sampler(1).train_batch(&data.train, 7, 0),
        single.train_batch(&data.train, 7, 1)
    );
    // A different seed draws different windows.
    let other = Sampler {
        seed: 4,
        ..sampler(0)
    };
    assert_ne!(
        other.train_batch(&data.train, 0, 0),
        sampler(0).train_batch(&data.train, 0, 0)
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_run_trains_on_a_shard_folder_and_a_mixture() {
    let d = tmp("run");
    // Two corpora: the built-in one's text as JSONL lines, and marked documents.
    let text = train::data::corpus::generate(7, 60_000);
    let lines: Vec<String> = text.lines().map(str::to_string).collect();
    std::fs::write(d.join("corpus.jsonl"), jsonl(&lines)).unwrap();
    let a = d.join("a");
    prepare(
        &[d.join("corpus.jsonl")],
        &Tokenizer::Byte,
        &a,
        &opts(20_000),
    )
    .unwrap();
    let b = marked_corpus(&d, 50, 90, 1000);
    let base = [
        "train.steps=3",
        "train.warmup_steps=1",
        "train.eval_every=3",
        "train.eval_batches=1",
        "train.sample_tokens=0",
    ];
    let with = |extra: String| -> RunConfig {
        let mut o: Vec<String> = base.iter().map(|s| s.to_string()).collect();
        o.push(extra);
        RunConfig::resolve("tiny", None, &o).unwrap()
    };
    let mut t = Trainer::single(with(format!("data.path=\"{}\"", a.display()))).unwrap();
    assert!(t.data.source.contains("shard folder"), "{}", t.data.source);
    let opts = RunOptions {
        out_dir: d.join("run"),
        quiet: true,
        trace: None,
    };
    let s = run(&mut t, &opts).unwrap();
    assert_eq!(s.losses.len(), 3);
    assert!(s.losses.iter().all(|l| l.is_finite()));
    assert!(s.val_loss.is_some_and(f64::is_finite));
    let mix = format!(
        "data.mix=[{{path=\"{}\", weight=0.7}}, {{path=\"{}\", weight=0.3}}]",
        a.display(),
        b.display()
    );
    let mut t = Trainer::single(with(mix)).unwrap();
    assert!(
        t.data.source.starts_with("mixture of 0.700 × shard folder"),
        "{}",
        t.data.source
    );
    let l = t.train_step().unwrap().loss;
    assert!(l.is_finite());
    // Both sources are drawn from, roughly in proportion.
    let from_b = (0..2000)
        .filter(|&g| t.data.train.locate(1, g).source == 1)
        .count();
    assert!(
        (450..750).contains(&from_b),
        "{from_b} of 2000 from the 0.3 source"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

/// Document boundaries reach the batches from the shards' indexes: in marked documents (each
/// ending with EOS 0), an input position opens a document exactly after an EOS; a stream
/// without an index gives no boundaries; a run with `data.document_mask` (and restarted
/// positions) trains; sources without boundaries and positions without the mask are
/// configuration errors.
#[test]
fn document_masks_come_from_the_shard_index() {
    let d = tmp("docmask");
    let out = marked_corpus(&d, 30, 6, 120);
    let seq = 16;
    let data = Dataset::load(
        &folder_cfg(&out.to_string_lossy(), 0.1),
        &Tokenizer::Byte,
        256,
        seq,
    )
    .unwrap();
    let sampler = Sampler {
        seed: 5,
        seq_len: seq,
        micro_batch: 4,
        grad_accum: 1,
        dp: 1,
        rank: 0,
    };
    let mut openings = 0;
    for step in 0..20 {
        let b = sampler.train_batch(&data.train, step, 0);
        let starts = b
            .doc_starts
            .as_ref()
            .expect("a shard folder records boundaries");
        for r in 0..b.batch {
            let (x, s) = (&b.inputs[r * seq..][..seq], &starts[r * seq..][..seq]);
            assert_eq!(s[0], 0, "a window opens a document at 0");
            for p in 1..seq {
                let opens = x[p - 1] == 0;
                assert_eq!(
                    s[p],
                    if opens { p } else { s[p - 1] },
                    "row {r} {x:?} {s:?}"
                );
                openings += usize::from(opens);
            }
        }
    }
    assert!(openings > 20, "windows cross documents: {openings}");
    let stream = Dataset::from_ids((0..500).map(|i| i % 7).collect(), 0.1, 256, seq).unwrap();
    assert_eq!(sampler.train_batch(&stream.train, 0, 0).doc_starts, None);

    let cfg = |extra: &[&str]| {
        let mut o = vec![
            format!("data.path=\"{}\"", out.display()),
            "train.steps=2".into(),
            "model.seq_len=16".into(),
            "data.val_fraction=0.3".into(),
            "train.sample_tokens=0".into(),
            "train.eval_batches=1".into(),
        ];
        o.extend(extra.iter().map(|s| s.to_string()));
        RunConfig::resolve("tiny", None, &o)
    };
    for extra in [
        &["data.document_mask=true"][..],
        &["data.document_mask=true", "data.document_positions=true"],
    ] {
        let mut t = Trainer::single(cfg(extra).unwrap()).unwrap();
        assert!(t.train_step().unwrap().loss.is_finite(), "{extra:?}");
        assert!(
            t.evaluate().unwrap().is_some_and(f64::is_finite),
            "{extra:?}"
        );
    }
    let err = |o: &[&str]| {
        RunConfig::resolve(
            "tiny",
            None,
            &o.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        )
        .unwrap_err()
        .to_string()
    };
    let e = err(&["data.document_mask=true"]);
    assert!(e.contains("the built-in corpus has none"), "{e}");
    let e = err(&["data.document_positions=true"]);
    assert!(e.contains("needs data.document_mask"), "{e}");
    std::fs::remove_dir_all(&d).unwrap();
}
