"""Alternating rounds of xtrain's pipeline-parallel training benchmark and its PyTorch peer
(`torch_pipeline.py`, torch.distributed.pipelining over gloo) on one machine, summarised as
medians and ratios.

Both run the `small` preset with 8 layers on pp = 2 ranks of 1 thread each, 8 micro-batches of
1 sequence per step (2048 tokens), one warm-up step and then the median of the timed steps.
A shared VM's speed drifts by 25–40 % between minutes, so each round runs xtrain 1f1b, torch
1f1b, xtrain gpipe, torch gpipe back to back, and the table gives per schedule both medians,
the ratio of the medians (xtrain / torch) and the range of the per-round ratios. Nothing else
should run meanwhile, and on a 2-core machine a compiler on one core halves a run's speed, so the
driver waits before every run until the machine is quiet (the CPU time of processes other than
its own children below 5 % of the machine over 2 s) and repeats a run during which other
processes took more than 5 % (`--foreign-limit`).

    pip install torch transformers
    cargo build --release -p xtrain
    python3 benches/peers/compare_pipeline.py --rounds 5
    python3 benches/peers/compare_pipeline.py --rounds 3 --schedule 1f1b --steps 10
"""

import argparse
import datetime
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOKENS = re.compile(r"([0-9]+) tokens/s")
LOSS = re.compile(r"first step: loss ([0-9.]+)")
CPUS = os.cpu_count()
TICK = os.sysconf("SC_CLK_TCK")


def cpu_s():
    """(CPU seconds the machine has been busy, CPU seconds of our waited-for descendants)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    own = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (user + nice + system + irq + softirq) / TICK, own.ru_utime + own.ru_stime


def foreign_share(f):
    """Calls f(); returns its result and the share of the machine that other processes used."""
    busy0, own0 = cpu_s()
    t0 = time.perf_counter()
    result = f()
    busy1, own1 = cpu_s()
    wall = time.perf_counter() - t0
    return result, max(0.0, (busy1 - busy0) - (own1 - own0)) / (wall * CPUS)


def wait_quiet(limit):
    waited = 0
    while (share := foreign_share(lambda: time.sleep(2))[1]) > limit:
        if waited % 60 == 0:
            print(f"  waiting for a quiet machine (others use {share:.0%})", flush=True)
        waited += 2


def run(cmd, limit, tries=5):
    """Runs `cmd` on a quiet machine; returns the last `N tokens/s` figure it printed, its output
    and the share of the machine other processes took meanwhile. Repeats the run (up to `tries`
    times) while that share is above `limit`."""
    name = Path(cmd[1] if cmd[0] == sys.executable else cmd[0]).name
    for attempt in range(1, tries + 1):
        wait_quiet(limit)
        out, share = foreign_share(lambda: subprocess.run(cmd, capture_output=True, text=True))
        found = TOKENS.findall(out.stdout + out.stderr)
        if out.returncode != 0 or not found:
            sys.exit(f"{' '.join(cmd)} failed (exit {out.returncode}):\n{out.stdout}{out.stderr}")
        if share <= limit or attempt == tries:
            return int(found[-1]), out.stdout + out.stderr, share
        print(f"  {name}: others took {share:.0%} of the machine during the run; repeating it", flush=True)


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--schedule", action="append", choices=["1f1b", "gpipe"],
                    help="schedules to run (repeatable; default 1f1b and gpipe)")
    ap.add_argument("--steps", default="6", help="timed steps after one warm-up step, for both programs")
    ap.add_argument("--xtrain", default="target/release/xtrain", help="path of the xtrain binary")
    ap.add_argument("--foreign-limit", type=float, default=0.05,
                    help="share of the machine other processes may use during a run (default 0.05)")
    args = ap.parse_args()
    schedules = args.schedule or ["1f1b", "gpipe"]
    results = {s: ([], []) for s in schedules}
    start = utc_now()
    for r in range(1, args.rounds + 1):
        for s in schedules:
            ours, _, ours_share = run([args.xtrain, "bench", "train", "--preset", "small", "--pp", "2",
                           "--microbatches", "8", "--schedule", s, "--set", "train.micro_batch=1",
                           "--set", "model.num_layers=8", "--threads", "1", "--steps", args.steps],
                          args.foreign_limit)
            torch, out, torch_share = run([sys.executable, str(HERE / "torch_pipeline.py"), "--schedule", s,
                              "--steps", args.steps], args.foreign_limit)
            loss = LOSS.search(out)
            results[s][0].append(ours)
            results[s][1].append(torch)
            print(f"round {r} {s}: xtrain {ours}, PyTorch {torch} ({ours / torch:.2f}x); "
                  f"others took {ours_share:.1%} and {torch_share:.1%} of the machine"
                  f"{f'; PyTorch first-step loss {loss.group(1)}' if loss else ''}", flush=True)
    print(f"\n{start} – {utc_now()}, {args.rounds} rounds of {args.steps} timed steps")
    print("\n| case | xtrain tokens/s (median, range) | PyTorch tokens/s (median, range) "
          "| ratio of medians | per-round ratios |")
    print("| --- | --- | --- | --- | --- |")
    for s, (ours, torch) in results.items():
        ratios = [o / t for o, t in zip(ours, torch)]
        mo, mt = statistics.median(ours), statistics.median(torch)
        print(f"| small 8 layers, pp=2 m=8 {s}, 1 thread/rank | {mo:,.0f} ({min(ours):,}–{max(ours):,}) "
              f"| {mt:,.0f} ({min(torch):,}–{max(torch):,}) | {mo / mt:.2f}× "
              f"| {min(ratios):.2f}–{max(ratios):.2f} |")


if __name__ == "__main__":
    main()
