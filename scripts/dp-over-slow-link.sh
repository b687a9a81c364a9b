#!/usr/bin/env bash
# Data parallelism over a slow network, on one machine: two network namespaces (two "hosts")
# joined by a veth pair whose both ends are rate-limited by `tc` (a token bucket), one rank
# per host, and the same dp2 run with each gradient wire format. Prints the median tokens/s
# and the bytes each rank sends per step. Needs root, iproute2 (`ip`, `tc`) and a release
# build (`cargo build --release -p xtrain`).
#
#   scripts/dp-over-slow-link.sh [RATE] [PRESET] [STEPS] [FORMATS...]
#   scripts/dp-over-slow-link.sh 1gbit tiny 200 fp32 bf16 fp8 powersgd:4
set -euo pipefail
cd "$(dirname "$0")/.."
rate=${1:-1gbit}
preset=${2:-tiny}
steps=${3:-200}
shift 3 2>/dev/null || shift $#
formats=("$@")
[ ${#formats[@]} -gt 0 ] || formats=(fp32 bf16 fp8 powersgd:4)
exe=$PWD/target/release/xtrain
[ -x "$exe" ] || { echo "build first: cargo build --release -p xtrain" >&2; exit 1; }

tag=$$
ns=("xtrain-bw$tag-0" "xtrain-bw$tag-1")
veth=("xb${tag}a" "xb${tag}b")
subnet=10.231.9
work=$(mktemp -d)
cleanup() {
    for n in "${ns[@]}"; do ip netns del "$n" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT
[ -z "${KEEP:-}" ] || trap - EXIT
for n in "${ns[@]}"; do ip netns add "$n"; done
ip link add "${veth[0]}" type veth peer name "${veth[1]}"
for k in 0 1; do
    ip link set "${veth[$k]}" netns "${ns[$k]}"
    ip -n "${ns[$k]}" addr add "$subnet.$((k + 1))/24" dev "${veth[$k]}"
    ip -n "${ns[$k]}" link set "${veth[$k]}" up
    ip -n "${ns[$k]}" link set lo up
    # Egress shaping on each end: `rate` each way, a 1 ms latency bound on the queue.
    ip netns exec "${ns[$k]}" tc qdisc add dev "${veth[$k]}" root tbf rate "$rate" \
        burst 256kb latency 1ms
done

echo "dp2 over a $rate link (two namespaces, one rank each), preset $preset, $steps steps"
printf "%-14s %14s %14s %14s\n" grad_comm "median tok/s" "dp MiB/step" "final loss"
for f in "${formats[@]}"; do
    out=$work/${f//:/-}
    token=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \n')
    for k in 1 0; do
        ip netns exec "${ns[$k]}" env XTRAIN_JOB_TOKEN="$token" RUST_BACKTRACE=0 "$exe" launch --nnodes 2 \
            --node-rank $k --nproc-per-node 1 --master-addr "$subnet.1" --master-port 29510 \
            -- "$exe" train --quiet --preset "$preset" --nproc 2 --dp 2 --set train.threads=1 \
            --set train.steps="$steps" --set "train.grad_comm=\"$f\"" --set train.eval_every=0 \
            --set train.ckpt_every=0 --out "$out" >"$out.$k.log" 2>&1 &
    done
    ok=1
    for j in $(jobs -p); do wait "$j" || ok=0; done
    if [ $ok = 0 ]; then tail -n 5 "$out".*.log >&2; exit 1; fi
    python3 - "$out/metrics.jsonl" "$f" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
steady = rows[len(rows) // 5:]  # past the warm-up steps
tok = statistics.median(r["tokens_per_s"] for r in steady)
print(f"{sys.argv[2]:<14} {tok:>14.0f} {rows[-1]['dp_bytes_sent'] / 2**20:>14.3f} "
      f"{rows[-1]['loss']:>14.4f}")
EOF
done
