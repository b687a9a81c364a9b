"""The peer of `xtrain tokenize --tokenizer tokenizer.json`: the Hugging Face `tokenizers`
package's batch encoding (`Tokenizer.encode_batch`, its Rust core on `--threads` rayon threads)
of the same files' documents, read and batched as xtrain does (JSONL: one document per line,
the string field `--field`; any other file: the whole file; batches of 4096 documents or 4 MiB
of text). Counts tokens as a shard folder does (each document's ids plus its end-of-document
token), and prints `D documents, T tokens, R tokens/s`, timed from the first read to the last
encoding (the tokenizer's loading excluded, as in xtrain's summary).

    pip install tokenizers
    python3 benches/peers/tokenize_peer.py --tokenizer tokenizer.json --threads 2 corpus.jsonl
"""

import argparse
import gzip
import json
import os
import sys
import time

BATCH_DOCS = 4096
BATCH_BYTES = 4 << 20


def documents(path, field):
    """The documents of one file, in order."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        if not path.removesuffix(".gz").endswith((".jsonl", ".ndjson")):
            yield f.read()
            return
        for n, line in enumerate(f, 1):
            if line.strip():
                text = json.loads(line).get(field)
                if not isinstance(text, str):
                    sys.exit(f"{path}:{n}: no string field {field!r}")
                yield text


def batches(paths, field):
    batch, size = [], 0
    for p in paths:
        for text in documents(p, field):
            if not text:
                continue
            batch.append(text)
            size += len(text)
            if len(batch) >= BATCH_DOCS or size >= BATCH_BYTES:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--tokenizer", required=True, help="a tokenizer.json")
    ap.add_argument("--field", default="text")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    # Read by the tokenizers library when its thread pool starts, which is after this.
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(args.tokenizer)
    start = time.perf_counter()
    docs = tokens = 0
    for batch in batches(args.files, args.field):
        encoded = tk.encode_batch(batch, add_special_tokens=False)
        docs += len(encoded)
        tokens += sum(len(e.ids) + 1 for e in encoded)
    seconds = time.perf_counter() - start
    print(f"{docs} documents, {tokens} tokens, {tokens / seconds:.0f} tokens/s, {seconds:.2f} s")


if __name__ == "__main__":
    main()
