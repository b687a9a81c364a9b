#!/usr/bin/env bash
# NCCL against the own engine on a machine with two or more GPUs (the GPU machines this
# project is checked on have one, where NCCL cannot pair two ranks): the same dp 2 run with
# XTRAIN_BACKEND=own (gradients and weight gathers through host memory) and
# XTRAIN_BACKEND=nccl (on the GPUs): dp 2 at ZeRO-0 to 3 in fp32 and ZeRO-1 and 3 in bf16
# (the gradient reductions and weight gathers, on the communication stream), tp 2 with and
# without sequence parallelism in fp32 (the region operators' collectives) and cp 2, ring and
# all-gather, in fp32 (the K/V blocks and their gradients), pp 2 under 1F1B, interleaved, ZB-V
# and DualPipeV in fp32 and 1F1B in bf16 (the pipeline links' activations and gradients, one
# communicator and side stream per link) and ep 2 on a mixture of experts in fp32 (the token
# rows' all-to-alls), 20 steps each;
# every loss and grad norm of the two must agree within 1e-5 relative (fp32; the sums differ
# only in order) and 1e-2 (bf16: 16-bit weights rounded from masters ~1e-7 apart). (One GPU
# checks the same paths with one-rank communicators:
# `nccl_with_one_rank_matches_the_own_engine_bit_for_bit` in xtrain/tests/gpu_processes.rs and
# `tp_regions_run_on_a_one_rank_nccl_communicator` and
# `context_attention_runs_on_a_one_rank_nccl_communicator` in train/tests/gpu_train.rs.)
#
#   scripts/nccl-parity.sh [XTRAIN_BINARY] [OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${1:-target/release/xtrain}
out=${2:-nccl-parity}
mkdir -p "$out"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -lt 2 ]; then
    echo "nccl-parity: needs 2 GPUs, this machine has $gpus" >&2
    exit 2
fi
status=0
# name, precision, layout
runs=(
    "fp32-zero0 fp32 --dp 2 --zero 0" "fp32-zero1 fp32 --dp 2 --zero 1"
    "fp32-zero2 fp32 --dp 2 --zero 2" "fp32-zero3 fp32 --dp 2 --zero 3"
    "bf16-zero1 bf16 --dp 2 --zero 1" "bf16-zero3 bf16 --dp 2 --zero 3"
    "fp32-tp2 fp32 --tp 2" "fp32-tp2-sp fp32 --tp 2 --sp"
    "fp32-cp2-ring fp32 --cp 2" "fp32-cp2-allgather fp32 --cp 2 --set parallel.cp_comm=\"allgather\""
    "fp32-pp2-1f1b fp32 --pp 2 --schedule 1f1b --microbatches 4"
    "fp32-pp2-interleaved fp32 --pp 2 --schedule interleaved --microbatches 4"
    "fp32-pp2-zbv fp32 --pp 2 --schedule zb-v --microbatches 4"
    "fp32-pp2-dualpipev fp32 --pp 2 --schedule dualpipev --microbatches 4"
    "bf16-pp2-1f1b bf16 --pp 2 --schedule 1f1b --microbatches 4"
    "fp32-ep2 fp32 --dp 2 --ep 2 --set model.arch=\"mixtral\" --set model.num_experts=4 --set model.experts_per_token=2"
)
for run in "${runs[@]}"; do
    read -r name precision layout <<<"$run"
    for backend in own nccl; do
        # shellcheck disable=SC2086 # the layout is words
        XTRAIN_BACKEND=$backend RUST_LOG=comm=info "$bin" train --preset small --device cuda \
            --nproc 2 $layout --set train.steps=20 --set "train.precision=\"$precision\"" \
            --out "$out/$name-$backend" >"$out/$name-$backend.log" 2>&1
    done
    tol=$([ "$precision" = fp32 ] && echo 1e-5 || echo 1e-2)
    python3 - "$out/$name-own/metrics.jsonl" "$out/$name-nccl/metrics.jsonl" "$tol" "$name" <<'PY' || status=1
import json, sys
own, nccl, tol, name = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
rows = lambda p: [json.loads(l) for l in open(p)]
a, b = rows(own), rows(nccl)
assert len(a) == len(b) == 20, (len(a), len(b))
worst = max(max(abs(x[k] - y[k]) / abs(x[k]) for k in ("loss", "grad_norm")) for x, y in zip(a, b))
print(f"{name}: nccl vs own, worst relative difference {worst:.2e} (bound {tol:g})")
sys.exit(0 if worst <= tol else 1)
PY
    grep -q "over NCCL" "$out/$name-nccl.log" || { echo "$name: NCCL was not used ($out/$name-nccl.log)"; status=1; }
done
exit $status
