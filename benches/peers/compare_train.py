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
    python3 benches/peers/compare_train.py --rounds 3 --isa avx512 --isa avx2

A case is `preset:threads:steps` (the timed steps after one warm-up step, for both programs).
`--isa` (repeatable) runs both programs once per kernel path in every case and round: xtrain
with `XTRAIN_ISA`, PyTorch limited to the same instructions (`avx2`: `ATEN_CPU_CAPABILITY=avx2`,
`MKL_ENABLE_INSTRUCTIONS=AVX2`, `ONEDNN_MAX_CPU_ISA=AVX2`; `avx512`: its defaults), so a forced
lower path is compared with PyTorch on that path, under the same machine load.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOKENS = re.compile(r"([0-9]+) tokens/s")
# The cases: small on 1 and 2 threads, medium on 2 threads.
DEFAULT_CASES = ["small:1:4", "small:2:4", "medium:2:3"]
# PyTorch's switches that keep ATen, MKL and oneDNN to a lower instruction set.
TORCH_ISA_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "ONEDNN_MAX_CPU_ISA": "AVX2"},
}


def env_for(isa, ours):
    """The environment of one run on kernel path `isa` (None: each program's default)."""
    env = dict(os.environ)
    env.pop("XTRAIN_ISA", None)
    for extra in TORCH_ISA_ENV.values():
        for k in extra:
            env.pop(k, None)
    if isa and ours:
        env["XTRAIN_ISA"] = isa
    elif isa:
        env.update(TORCH_ISA_ENV.get(isa, {}))
    return env


def tokens_per_s(cmd, env=None):
    """Runs `cmd` and returns the last `N tokens/s` figure it printed."""
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    found = TOKENS.findall(out.stdout + out.stderr)
    if out.returncode != 0 or not found:
        sys.exit(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stdout}{out.stderr}")
    return int(found[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--case", action="append", help="preset:threads:steps (repeatable)")
    ap.add_argument("--xtrain", default="target/release/xtrain", help="path of the xtrain binary")
    ap.add_argument("--isa", action="append", help="kernel path for xtrain (XTRAIN_ISA; repeatable)")
    args = ap.parse_args()
    cases = [c.split(":") for c in (args.case or DEFAULT_CASES)]
    isas = args.isa or [None]
    # results[case][isa] = (PyTorch figures, xtrain figures)
    results = {tuple(c): {isa: ([], []) for isa in isas} for c in cases}
    for r in range(1, args.rounds + 1):
        for preset, threads, steps in cases:
            common = ["--preset", preset, "--threads", threads, "--steps", steps]
            line = f"round {r} {preset} {threads}t:"
            for isa in isas:
                torch = tokens_per_s(
                    [sys.executable, str(HERE / "torch_peer.py"), "train", *common],
                    env_for(isa, False))
                ours = tokens_per_s([args.xtrain, "bench", "train", *common], env_for(isa, True))
                results[(preset, threads, steps)][isa][0].append(torch)
                results[(preset, threads, steps)][isa][1].append(ours)
                line += f" [{isa or 'default'}] PyTorch {torch}, xtrain {ours} ({ours / torch:.2f}x)"
            print(line, flush=True)
    print("\n| preset, threads | PyTorch tokens/s (median, range) | xtrain tokens/s (median, range) "
          "| ratio of medians | per-round ratios |")
    print("| --- | --- | --- | --- | --- |")
    for (preset, threads, _), by_isa in results.items():
        for isa, (torch, ours) in by_isa.items():
            ratios = [o / t for o, t in zip(ours, torch)]
            mt, mo = statistics.median(torch), statistics.median(ours)
            path = f" ({isa})" if isa else ""
            print(f"| {preset}, {threads}{path} | {mt:,.0f} ({min(torch):,}–{max(torch):,}) "
                  f"| {mo:,.0f} ({min(ours):,}–{max(ours):,}) | {mo / mt:.2f}× "
                  f"| {min(ratios):.2f}–{max(ratios):.2f} |")


if __name__ == "__main__":
    main()
