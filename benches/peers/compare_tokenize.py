"""Alternating rounds of `xtrain tokenize --tokenizer tokenizer.json` and its peer
(`tokenize_peer.py`: the `tokenizers` package's `encode_batch`) on the same JSONL corpus with
the same tokenizer and thread count, summarised as medians and ratios.

The corpus and tokenizer are made from one text file (`--text`, e.g. tinyshakespeare) in
`--work` unless already there: a byte-level BPE (`tokenizers`' trainer, `<|endoftext|>`
special token, vocabulary `--vocab` or as many merges as the text has) saved as
`tokenizer.json`, and `corpus.jsonl`, documents of 8 consecutive paragraphs of the text,
cycling, up to `--corpus-mb` MB. Each round runs, per thread count, xtrain then the peer back
to back (a shared VM's speed drifts between minutes), each on a quiet machine as in
`compare_pipeline.py`. Both must report the same documents and tokens (the same encoding);
xtrain's figure also includes writing the shards.

    pip install tokenizers
    cargo build --release -p xtrain
    python3 benches/peers/compare_tokenize.py --text input.txt --work /tmp/tok --rounds 3
"""

import argparse
import json
import re
import shutil
import statistics
import sys
from pathlib import Path

from compare_pipeline import run, utc_now

HERE = Path(__file__).resolve().parent
COUNTS = re.compile(r"([0-9]+) documents, ([0-9]+) tokens")


def make_inputs(text_path, work, vocab, corpus_mb):
    """tokenizer.json and corpus.jsonl in `work`, made unless present."""
    work.mkdir(parents=True, exist_ok=True)
    tok, corpus = work / "tokenizer.json", work / "corpus.jsonl"
    if not tok.exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tk = Tokenizer(models.BPE())
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tk.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=2, show_progress=False,
                                      special_tokens=["<|endoftext|>"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tk.train([str(text_path)], trainer)
        tk.save(str(tok))
    if not corpus.exists():
        paragraphs = [p for p in Path(text_path).read_text().split("\n\n") if p.strip()]
        with open(corpus, "w") as f:
            written, i = 0, 0
            while written < corpus_mb * 1_000_000:
                doc = "\n\n".join(paragraphs[(i + j) % len(paragraphs)] for j in range(8))
                line = json.dumps({"text": doc}) + "\n"
                f.write(line)
                written += len(line)
                i += 8
    return tok, corpus


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--text", required=True, help="text file the tokenizer and corpus are made from")
    ap.add_argument("--work", required=True, help="folder for tokenizer.json, corpus.jsonl and the output")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--corpus-mb", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, action="append", help="thread counts (repeatable; default 1 and 2)")
    ap.add_argument("--xtrain", default="target/release/xtrain", help="path of the xtrain binary")
    ap.add_argument("--foreign-limit", type=float, default=0.05,
                    help="share of the machine other processes may use during a run (default 0.05)")
    args = ap.parse_args()
    work = Path(args.work)
    tok, corpus = make_inputs(args.text, work, args.vocab, args.corpus_mb)
    threads = args.threads or [1, 2]
    results = {t: ([], []) for t in threads}
    out = work / "shards"
    start = utc_now()
    for r in range(1, args.rounds + 1):
        for t in threads:
            shutil.rmtree(out, ignore_errors=True)
            ours, ours_text, ours_share = run([args.xtrain, "tokenize", str(corpus), "-o", str(out),
                                               "--tokenizer", str(tok), "--threads", str(t)],
                                              args.foreign_limit)
            shutil.rmtree(out, ignore_errors=True)
            peer, peer_text, peer_share = run([sys.executable, str(HERE / "tokenize_peer.py"), str(corpus),
                                               "--tokenizer", str(tok), "--threads", str(t)],
                                              args.foreign_limit)
            if COUNTS.findall(ours_text) != COUNTS.findall(peer_text):
                sys.exit(f"different encodings:\n{ours_text}\n{peer_text}")
            results[t][0].append(ours)
            results[t][1].append(peer)
            print(f"round {r}, {t} thread(s): xtrain {ours}, tokenizers {peer} ({ours / peer:.2f}x); "
                  f"others took {ours_share:.1%} and {peer_share:.1%} of the machine", flush=True)
    docs, tokens = COUNTS.findall(ours_text)[-1]
    print(f"\n{start} – {utc_now()}, {args.rounds} rounds; {corpus.stat().st_size / 1e6:.1f} MB, "
          f"{docs} documents, {tokens} tokens")
    print("\n| threads | xtrain tokens/s (median, range) | tokenizers tokens/s (median, range) "
          "| ratio of medians | per-round ratios |")
    print("| --- | --- | --- | --- | --- |")
    for t, (ours, peer) in results.items():
        ratios = [o / p for o, p in zip(ours, peer)]
        mo, mp = statistics.median(ours), statistics.median(peer)
        print(f"| {t} | {mo:,.0f} ({min(ours):,}–{max(ours):,}) | {mp:,.0f} ({min(peer):,}–{max(peer):,}) "
              f"| {mo / mp:.2f}× | {min(ratios):.2f}–{max(ratios):.2f} |")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
