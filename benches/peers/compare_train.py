"""Alternating rounds of `xtrain bench train` and its PyTorch peer (`torch_peer.py train`) on
one machine, summarised as medians and ratios.

A shared VM's speed drifts by 25–40 % between minutes, so figures taken at different times do
not compare; this driver runs the two programs back to back for every case of every round, so
each round's ratio sees the same machine, and prints per case: both medians, the ratio of the
medians and the range of the per-round ratios. Nothing else should run meanwhile.

    pip install torch transformers
    cargo build --release -p xtrain
    python3 benches/peers/compare_train.py --rounds 5
    python3 benches/peers/compare_train.py --rounds 3 --case small:1:4 --case medium:2:3

A case is `preset:threads:steps` (the timed steps after one warm-up step, for both programs).
"""

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOKENS = re.compile(r"([0-9]+) tokens/s")
# The cases: small on 1 and 2 threads, medium on 2 threads.
DEFAULT_CASES = ["small:1:4", "small:2:4", "medium:2:3"]


def tokens_per_s(cmd):
    """Runs `cmd` and returns the last `N tokens/s` figure it printed."""
    out = subprocess.run(cmd, capture_output=True, text=True)
    found = TOKENS.findall(out.stdout + out.stderr)
    if out.returncode != 0 or not found:
        sys.exit(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stdout}{out.stderr}")
    return int(found[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--case", action="append", help="preset:threads:steps (repeatable)")
    ap.add_argument("--xtrain", default="target/release/xtrain", help="path of the xtrain binary")
    args = ap.parse_args()
    cases = [c.split(":") for c in (args.case or DEFAULT_CASES)]
    results = {tuple(c): ([], []) for c in cases}
    for r in range(1, args.rounds + 1):
        for preset, threads, steps in cases:
            common = ["--preset", preset, "--threads", threads, "--steps", steps]
            torch = tokens_per_s([sys.executable, str(HERE / "torch_peer.py"), "train", *common])
            ours = tokens_per_s([args.xtrain, "bench", "train", *common])
            results[(preset, threads, steps)][0].append(torch)
            results[(preset, threads, steps)][1].append(ours)
            print(f"round {r} {preset} {threads}t: PyTorch {torch}, xtrain {ours} ({ours / torch:.2f}x)")
    print("\n| preset, threads | PyTorch tokens/s (median, range) | xtrain tokens/s (median, range) "
          "| ratio of medians | per-round ratios |")
    print("| --- | --- | --- | --- | --- |")
    for (preset, threads, _), (torch, ours) in results.items():
        ratios = [o / t for o, t in zip(ours, torch)]
        mt, mo = statistics.median(torch), statistics.median(ours)
        print(f"| {preset}, {threads} | {mt:,.0f} ({min(torch):,}–{max(torch):,}) "
              f"| {mo:,.0f} ({min(ours):,}–{max(ours):,}) | {mo / mt:.2f}× "
              f"| {min(ratios):.2f}–{max(ratios):.2f} |")


if __name__ == "__main__":
    main()
