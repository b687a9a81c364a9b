#!/usr/bin/env bash
# The prepared GPU check: every GPU test and benchmark in one command, under 8 minutes,
# writing a report. Two steps, because the GPU machine has no Rust toolchain:
#
#   scripts/gpu-check.sh build        # here: builds the GPU test binaries and xtrain, strips
#                                     # them into .gpu-check/ (ignored by git, < 64 MiB)
#   scripts/gpu-check.sh run [OUT]    # on the GPU machine, from the repository root: runs
#                                     # them with XTRAIN_REQUIRE_GPU=1 (a skip is a failure)
#                                     # and writes OUT/report.md (default: ./gpu-report)
#
# The report names the GPU, the driver and the CUDA version (nvidia-smi), NVRTC's version,
# and each test's result, and ends with the check's duration; past GPU_CHECK_BUDGET seconds
# (default 450) the optional sections say "skipped (time budget)" instead of running.
# GPU_CHECK_ONLY="tests bench" (any of: tests bench probe processes convergence ncu large
# validate) runs only those sections: a rerun after a fix, within the machine's time. The CUDA
# libraries (NVRTC, cuBLASLt, NCCL) are found in a CUDA toolkit or in the pip wheels of the
# machine's Python (nvidia-cuda-nvrtc, nvidia-cublas, nvidia-nccl-cu12 / -cu13), whose
# folders go in XTRAIN_CUDA_LIB_PATH.
set -uo pipefail
cd "$(dirname "$0")/.."
dir=.gpu-check

build() {
    set -e
    rm -rf "$dir" && mkdir -p "$dir"
    cargo build --release -p xtrain
    cp target/release/xtrain "$dir/xtrain"
    # Test binaries: cargo prints their paths as JSON artifacts.
    cargo test --release -p tensor -p model -p train -p xtrain --test cuda_kernels \
        --test cuda_kernels_compile --test gpu_nccl --test gpu_model --test gpu_train \
        --test gpu_processes --no-run \
        --message-format=json |
        python3 -c '
import json, sys
for line in sys.stdin:
    try: m = json.loads(line)
    except ValueError: continue
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])
' | while read -r name exe; do cp "$exe" "$dir/$name"; done
    strip "$dir"/*
    # The real corpus of the bf16 convergence check, where this checkout has it beside it.
    if [ -f ../shared/data/tinyshakespeare.txt ]; then
        cp ../shared/data/tinyshakespeare.txt "$dir/"
    fi
    du -sh "$dir"
    ls -la "$dir"
}

# Whether `$1` more seconds fit in the check's budget (GPU_CHECK_BUDGET, default 450 s from the
# start of `run`): the optional sections (planner, per-layout throughput, Nsight Compute) are
# skipped, saying so, rather than the whole check overrunning the machine's time.
have_time() {
    ((SECONDS + $1 <= ${GPU_CHECK_BUDGET:-450}))
}

# The GPU test binaries, side by side.
check_tests() {
    # The test binaries run side by side (each its own process and CUDA context; the kernel
    # cache is written atomically per process), then report in a fixed order.
    local t
    local tests=(cuda_kernels_compile cuda_kernels gpu_nccl gpu_model gpu_train gpu_processes)
    for t in "${tests[@]}"; do
        [ -x "$dir/$t" ] || continue
        (
            start=$SECONDS
            timeout 300 "$dir/$t" --test-threads=1 --skip on_the_emulated_device >"$out/$t.log" 2>&1
            echo "$? $((SECONDS - start))" >"$out/$t.rc"
        ) &
    done
    wait
    for t in "${tests[@]}"; do
        if [ ! -x "$dir/$t" ]; then
            echo "- $t: MISSING (run scripts/gpu-check.sh build first)" >>"$report"
            failed=1
            continue
        fi
        read -r code secs <"$out/$t.rc"
        rm -f "$out/$t.rc"
        if [ "$code" = 0 ]; then
            echo "- $t: ok ($secs s)" >>"$report"
        else
            echo "- $t: FAILED (exit $code, $secs s), see $t.log" >>"$report"
            failed=1
        fi
        grep -E '^test |test result' "$out/$t.log" | sed 's/^/    /' >>"$report"
    done
}

# One Llama shape in bf16, alternating: xtrain, then the PyTorch peer. $1: the label, $2: steps, $3: the peer's --model
# (vocab,hidden,ffn,layers,heads,kv_heads,seq,micro_batch), the rest: xtrain's overrides.
bench_llama() {
    local label=$1 steps=$2 model=$3
    shift 3
    timeout 120 "$dir/xtrain" bench train --preset medium --device cuda --steps "$steps" "$@" \
        >>"$report" 2>&1 || echo "xtrain bench $label bf16 failed" >>"$report"
    # $peer_extra: more options for the peer (the 1B's --profile: its kernels beside xtrain's).
    PYTHONUNBUFFERED=1 timeout 120 python3 benches/peers/torch_peer.py train --device cuda --dtype bf16 \
        --model "$model" --steps "$steps" ${peer_extra:-} >>"$report" 2>&1 ||
        echo "torch peer $label bf16 failed" >>"$report"
}

# Throughput: xtrain beside the PyTorch peer.
check_bench() {
    # Alternating xtrain and the PyTorch peer on the same GPU: `small` in fp32 (TF32 off),
    # `medium` and the 124M-class Llama (`m124`, run()) in bf16.
    {
        echo
        echo "## Benchmarks (xtrain then PyTorch, alternating, twice)"
        echo
        echo '```'
    } >>"$report"
    # The small models once (launch-bound: xtrain 2.1-2.4x PyTorch when last measured), the
    # 124M twice.
    timeout 120 "$dir/xtrain" bench train --preset small --device cuda --steps 10 "${fp32[@]}" \
        >>"$report" 2>&1 || echo "xtrain bench small fp32 failed" >>"$report"
    PYTHONUNBUFFERED=1 timeout 120 python3 benches/peers/torch_peer.py train \
        --preset small --device cuda --steps 10 >>"$report" 2>&1 ||
        echo "torch peer small fp32 failed" >>"$report"
    timeout 120 "$dir/xtrain" bench train --preset medium --device cuda --steps 10 "${bf16[@]}" \
        >>"$report" 2>&1 || echo "xtrain bench medium bf16 failed" >>"$report"
    PYTHONUNBUFFERED=1 timeout 120 python3 benches/peers/torch_peer.py train --preset medium \
        --device cuda --dtype bf16 --steps 10 >>"$report" 2>&1 || echo "torch peer medium bf16 failed" >>"$report"
    for round in 1 2; do
        bench_llama 124M 10 32000,768,2048,12,12,12,1024,8 "${m124[@]}" "${bf16[@]}"
    done
    # fp16 (loss scaling; attention on the tensor cores in fp16), xtrain once.
    echo "[xtrain, 124M fp16]" >>"$report"
    timeout 120 "$dir/xtrain" bench train --preset medium --device cuda --steps 10 "${m124[@]}" \
        --set 'train.precision="fp16"' >>"$report" 2>&1 || echo "xtrain bench 124M fp16 failed" >>"$report"
    # Attention forward + backward against the MLP product per FLOP, at the 124M's shapes
    # (the issue's floor: within 2×), the backward's split and fused kernels alternating;
    # and over packed documents of 256 tokens (the _docs kernels: their time against their
    # share of the causal pairs, 0.25).
    timeout 60 "$dir/xtrain" bench kernels --preset medium --device cuda "${m124[@]}" "${bf16[@]}" \
        --doc-len 256 >>"$report" 2>&1 || echo "xtrain bench kernels failed" >>"$report"
    echo '```' >>"$report"
}

# Processes sharing the GPU: the launcher, per-layout throughput, staged collectives,
# the planner's calibration, the refusal of NCCL on a shared GPU.
check_processes() {
    # Launched processes sharing the GPU (each opens cuda:LOCAL_RANK mod count): dp 2 at
    # ZeRO-2 and pp 2 1F1B through the CLI, 30 steps each (the parity against one GPU is in
    # gpu_train's layouts test; this is the launcher, the store and the processes' contexts).
    {
        echo
        echo "## Processes sharing the GPU (tiny, 30 steps)"
        echo
        echo '```'
    } >>"$report"
    for layout in "--dp 2 --zero 2" "--pp 2 --schedule 1f1b"; do
        local tag=${layout// /}
        if timeout 120 "$dir/xtrain" train --preset tiny --device cuda --nproc 2 $layout \
            --set train.steps=30 --out "$out/procs$tag" >"$out/procs$tag.log" 2>&1; then
            echo "nproc 2 $layout: ok, $(grep -o 'loss [0-9.]* -> [0-9.]*' "$out/procs$tag.log" | tail -1)" >>"$report"
        else
            echo "nproc 2 $layout: FAILED (log: procs$tag.log)" >>"$report"
            failed=1
        fi
    done
    # The planner calibrated on this GPU (peaks, a layer's efficiency, the optimizer's
    # bandwidth, host copies) and its ranking of the medium preset at 1024 tokens.
    if have_time 90; then
        timeout 90 "$dir/xtrain" plan --cluster this --device cuda --model medium --seq-len 1024 \
            --top 5 --save-cluster "$out/cluster-this.json" >>"$report" 2>&1 ||
            echo "xtrain plan --cluster this --device cuda failed" >>"$report"
        # The calibrated figures (peaks, efficiency, bandwidths, links), for docs/PLAN.md.
        [ -f "$out/cluster-this.json" ] && tr -d ' \n' <"$out/cluster-this.json" >>"$report" && echo >>"$report"
    else
        echo "xtrain plan --cluster this --device cuda: skipped (time budget)" >>"$report"
    fi
    # Throughput of layouts as processes sharing the one GPU (small, bf16, 5 steps): what the
    # host-staged communication costs where the ranks share a card (their parity is in
    # gpu_processes above).
    # Each entry: processes, preset, layout (every layout of the parity test).
    local layouts=("2 small --dp 2 --zero 1" "2 small --dp 2 --zero 3" "2 small --tp 2 --sp"
        "2 small --pp 2 --schedule 1f1b" "2 small --pp 2 --schedule zb-v" "2 small --cp 2"
        "2 moe-small --ep 2" "4 small --pp 2 --dp 2" "4 small --cp 2 --tp 2")
    local entry
    for entry in "${layouts[@]}"; do
        set -- $entry
        local nproc=$1 preset=$2
        shift 2
        if ! have_time 60; then
            echo "bench nproc $nproc $preset $*: skipped (time budget)" >>"$report"
            continue
        fi
        echo "bench nproc $nproc $preset $*:" >>"$report"
        timeout 90 "$dir/xtrain" bench train --preset "$preset" --device cuda --nproc "$nproc" "$@" \
            --steps 5 2>&1 | grep -E '^preset|median step|peak live|memory of rank' >>"$report" ||
            echo "  failed" >>"$report"
    done
    # The host-staged all-reduce of two ranks sharing the GPU against the device <-> host
    # copies alone, measured in the same run (issue "Every layout on GPUs").
    if have_time 40; then
        echo "bench comm --nproc 2 --device cuda (all-reduce staged through host memory):" >>"$report"
        timeout 60 "$dir/xtrain" bench comm --nproc 2 --device cuda --min 1M --max 256M \
            --factor 4 --iters 5 --warmup 2 >>"$report" 2>&1 || echo "  failed" >>"$report"
    else
        echo "bench comm --device cuda: skipped (time budget)" >>"$report"
    fi
    # XTRAIN_BACKEND=nccl with two ranks on this one GPU: refused by name before NCCL runs.
    if XTRAIN_BACKEND=nccl timeout 60 "$dir/xtrain" train --preset tiny --device cuda \
        --nproc 2 --dp 2 --set train.steps=2 --out "$out/nccl-shared" >"$out/nccl-shared.log" 2>&1 ||
        ! grep -q "one GPU per rank" "$out/nccl-shared.log"; then
        echo "XTRAIN_BACKEND=nccl, 2 ranks on 1 GPU: NOT refused by name (log: nccl-shared.log)" >>"$report"
        failed=1
    else
        echo "XTRAIN_BACKEND=nccl, 2 ranks on 1 GPU: refused, naming the shared GPU" >>"$report"
    fi
    echo '```' >>"$report"
}

# The planner's predictions against measured GPU runs.
check_validate() {
    # The planner against measured runs on this GPU (medium bf16 and fp32 on one GPU; dp 2
    # and tp 2 where there are two): predicted and measured step time and memory.
    {
        echo
        echo "## xtrain plan --validate --device cuda"
        echo
        echo '```'
        if have_time 200; then
            timeout 100 "$dir/xtrain" plan --validate --device cuda --rounds 1 --steps 3 2>&1 ||
                echo "xtrain plan --validate --device cuda: FAILED or timed out"
        else
            echo "skipped (time budget)"
        fi
        echo '```'
    } >>"$report"
}

# bf16 training on the GPU against fp32 on the CPU, 1500 steps.
check_convergence() {
    # bf16 convergence: preset tiny, 1500 steps, the final validation loss of the GPU in
    # bf16 within 0.03 of the CPU in fp32 (tinyshakespeare where present, else the built-in
    # corpus).
    local data=()
    [ -f "$dir/tinyshakespeare.txt" ] && data=(--set "data.path=\"$dir/tinyshakespeare.txt\"")
    {
        echo
        echo "## bf16 convergence (tiny, 1500 steps${data:+, tinyshakespeare}): GPU bf16 vs CPU fp32"
        echo
        echo '```'
    } >>"$report"
    local vals=()
    for run in "cpu fp32" "cuda bf16"; do
        set -- $run
        local log="$out/converge-$1.log"
        timeout 300 "$dir/xtrain" train --preset tiny --device "$1" \
            --set "train.precision=\"$2\"" "${data[@]}" --out "$out/converge-$1" >"$log" 2>&1
        local v
        v=$(grep -o 'validation loss [0-9.]* after step 1500' "$log" | tail -1 | awk '{print $3}')
        echo "$1 $2: final validation loss ${v:-MISSING} (log: converge-$1.log)" >>"$report"
        vals+=("${v:-nan}")
    done
    if python3 -c "import sys; a, b = map(float, sys.argv[1:]); sys.exit(0 if abs(a - b) <= 0.03 else 1)" "${vals[@]}"; then
        echo "bf16 within 0.03 of fp32: yes" >>"$report"
    else
        echo "bf16 within 0.03 of fp32: NO" >>"$report"
        failed=1
    fi
    echo '```' >>"$report"
}

# Budget allowing, after everything else: the 124M under torch.compile (the issue's target
# peer; its compilation takes a minute or more) and a ~1B Llama, xtrain and PyTorch.
check_large() {
    {
        echo
        echo "## torch.compile and a ~1B Llama (budget allowing)"
        echo
        echo '```'
    } >>"$report"
    if have_time 180; then
        PYTHONUNBUFFERED=1 timeout 180 python3 benches/peers/torch_peer.py train --device cuda --dtype bf16 \
            --model 32000,768,2048,12,12,12,1024,8 --steps 10 --compile >>"$report" 2>&1 ||
            echo "torch peer 124M bf16 compiled failed or timed out" >>"$report"
    else
        echo "torch peer 124M bf16 compiled: skipped (time budget)" >>"$report"
    fi
    # A ~1B Llama (16 layers, hidden 2048, 16 heads, ffn 5504, vocab 32000, seq 1024,
    # micro-batch 4) in bf16, once each.
    local m1b=(--set model.vocab_size=32000 --set model.hidden_size=2048 --set model.intermediate_size=5504
        --set model.num_layers=16 --set model.num_heads=16 --set model.num_kv_heads=16
        --set model.seq_len=1024 --set train.micro_batch=4 --set 'data.tokenizer="byte"')
    if ! have_time 150; then
        echo "1B bf16: skipped (time budget)" >>"$report"
        echo '```' >>"$report"
        return
    fi
    peer_extra=--profile bench_llama 1B 5 32000,2048,5504,16,16,16,1024,4 "${m1b[@]}" "${bf16[@]}"
    echo '```' >>"$report"
}

# Hopper's warpgroup product (wgmma), probed: which shared-memory layouts, descriptors and
# register fragments give the product (dev/wgmma/probe.py, a few seconds; prints a line per
# candidate) — the ground truth for the Hopper attention kernels to come — and an attention
# forward prototype on them (dev/wgmma/attn_fwd.py) checked and timed against PyTorch's.
check_probe() {
    {
        echo
        echo "## wgmma probes (dev/wgmma)"
        echo
        echo '```'
    } >>"$report"
    timeout 90 python3 dev/wgmma/probe.py >>"$report" 2>&1 || echo "probe: exit $?" >>"$report"
    # The attention forward prototype on those products against PyTorch's, timed beside it.
    timeout 120 python3 dev/wgmma/attn_fwd.py >>"$report" 2>&1 ||
        echo "attn_fwd: exit $?" >>"$report"
    echo '```' >>"$report"
}

# Nsight Compute on the attention kernels, where installed.
check_ncu() {
    # Where Nsight Compute is installed: each tensor-core attention kernel once, at the 124M's
    # shapes (`bench kernels`; causal, and over packed documents of 256 tokens) — registers,
    # occupancy, throughput against the peaks, shared-memory wavefronts and bank conflicts,
    # and where the warps stall — for whoever tunes them next (ncu-attention.txt).
    if ! command -v ncu >/dev/null || ! have_time 120; then
        return
    fi
    local kernel ok=1
    : >"$out/ncu-attention.txt"
    # Every kernel choice `bench kernels` times (tensor::cuda::ops::AttnKernels): the forward
    # and dQ with one and two m-tiles a warp, the split and the fused backward.
    local entries=(attn_fwd_tc_k4 attn_fwd_tc_m2_k4 attn_bwd_dq_tc_k4 attn_bwd_dq_tc_m2_k4
        attn_bwd_dkv_tc_k4 attn_bwd_fused_tc_k4 attn_fwd_tc_docs_k4 attn_bwd_dkv_tc_docs_k4)
    for kernel in "${entries[@]}"; do
        if ! have_time 45; then
            echo "=== $kernel: skipped (time budget)" >>"$out/ncu-attention.txt"
            continue
        fi
        echo "=== $kernel" >>"$out/ncu-attention.txt"
        timeout 40 ncu --kernel-name "regex:^${kernel}\$" --launch-count 1 \
            --section SpeedOfLight --section LaunchStats --section Occupancy \
            --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
            --section SchedulerStats --section InstructionStats \
            "$dir/xtrain" bench kernels --preset medium --device cuda "${m124[@]}" "${bf16[@]}" \
            --doc-len 256 --reps 1 >>"$out/ncu-attention.txt" 2>&1 || ok=0
    done
    if [ $ok = 1 ]; then
        echo "Nsight Compute profile: ncu-attention.txt" >>"$report"
    else
        echo "Nsight Compute profile: failed or timed out (ncu-attention.txt)" >>"$report"
    fi
}

run() {
    SECONDS=0
    local out=${1:-gpu-report}
    mkdir -p "$out"
    local report="$out/report.md"
    # NVRTC, cuBLASLt and NCCL from the machine's Python wheels, if no toolkit provides them.
    local libs
    libs=$(python3 - <<'PY' 2>/dev/null
import glob, os, site
roots = site.getsitepackages() + [site.getusersitepackages()]
dirs = set()
for r in roots:
    for pat in ("nvidia/*/lib", "nvidia/cu*/lib"):
        for d in glob.glob(os.path.join(r, pat)):
            if any(glob.glob(os.path.join(d, lib)) for lib in ("libnvrtc.so*", "libcublasLt.so*", "libnccl.so*")):
                dirs.add(d)
print(":".join(sorted(dirs)))
PY
)
    export XTRAIN_CUDA_LIB_PATH="${XTRAIN_CUDA_LIB_PATH:+$XTRAIN_CUDA_LIB_PATH:}$libs"
    # Backtraces for panics (a test failing), not for the errors a command reports.
    export XTRAIN_REQUIRE_GPU=1 XTRAIN_REQUIRE=gpu,nvrtc RUST_BACKTRACE=1 RUST_LIB_BACKTRACE=0
    export XTRAIN_KERNEL_CACHE="$out/kernel-cache" XTRAIN_BIN="$PWD/$dir/xtrain"
    {
        echo "# xtrain GPU check, $(date -u '+%Y-%m-%d %H:%M UTC')"
        echo
        echo '```'
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
        nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*'
        echo "XTRAIN_CUDA_LIB_PATH=$XTRAIN_CUDA_LIB_PATH"
        echo '```'
        echo
    } >"$report"
    local failed=0
    # The model shapes of the benchmarks: a 124M-class Llama (12 layers, hidden 768, 12 heads,
    # seq 1024, vocab 32000, micro-batch 8) and the formats.
    local m124=(--set model.vocab_size=32000 --set model.hidden_size=768 --set model.intermediate_size=2048
        --set model.num_layers=12 --set model.num_heads=12 --set model.num_kv_heads=12
        --set model.seq_len=1024 --set train.micro_batch=8 --set 'data.tokenizer="byte"')
    local bf16=(--set 'train.precision="bf16"') fp32=(--set 'train.precision="fp32"')
    local section
    for section in tests bench probe processes convergence ncu large validate; do
        if [ -z "${GPU_CHECK_ONLY:-}" ] || [[ " $GPU_CHECK_ONLY " == *" $section "* ]]; then
            "check_$section"
        else
            echo "($section: not in GPU_CHECK_ONLY)" >>"$report"
        fi
    done
    echo "The check took $SECONDS s (budget ${GPU_CHECK_BUDGET:-450} s)." >>"$report"
    cat "$report"
    return $failed
}

# ZeRO-Offload on a model whose optimizer state does not fit beside it on an 80 GB GPU: a 7B
# Llama (hidden 4096, 32 layers, ffn 11008, vocab 32000; 6.7 G parameters) in bf16, the
# 16-bit weights and gradients on the GPU (2 x 13.5 GB), the fp32 master and moments on the
# host (81 GB): tokens/s, GPU and host memory, updating in place and with the delayed update
# (the host's AdamW beside the next step: `parallel.delayed_update_after`, 13.5 GB more of
# page-locked host memory), against the same model resident where the GPU holds it. Four
# micro-batches a step, so that the GPU's part is not negligible beside the host's. Separate
# from `run` (it needs ~110 GB of host memory and a few minutes):
# scripts/gpu-check.sh offload [OUT].
offload() {
    local out=${1:-gpu-report}
    mkdir -p "$out"
    local report="$out/offload.md"
    {
        echo "# xtrain ZeRO-Offload check, $(date -u '+%Y-%m-%d %H:%M UTC')"
        echo
        echo '```'
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
        free -g | head -2
    } >"$report"
    local llama7b=(--set model.hidden_size=4096 --set model.num_layers=32
        --set model.num_heads=32 --set model.num_kv_heads=32
        --set model.intermediate_size=11008 --set model.vocab_size=32000
        --set model.seq_len=256 --set train.micro_batch=1 --set 'train.precision="bf16"'
        --set 'data.tokenizer="byte"' --set train.grad_accum=4)
    XTRAIN_KERNEL_CACHE="$out/kernel-cache" timeout 300 "$dir/xtrain" bench train \
        --preset medium --device cuda --offload optimizer --steps 2 "${llama7b[@]}" \
        >>"$report" 2>&1 || echo "offload 7B: FAILED or timed out" >>"$report"
    echo "--- the same, every update delayed a step ---" >>"$report"
    XTRAIN_KERNEL_CACHE="$out/kernel-cache" timeout 300 "$dir/xtrain" bench train \
        --preset medium --device cuda --offload optimizer --steps 2 "${llama7b[@]}" \
        --set parallel.delayed_update_after=0 \
        >>"$report" 2>&1 || echo "delayed offload 7B: FAILED or timed out" >>"$report"
    # The peer on a card that holds the whole optimizer (an H200's 141 GB does; a smaller
    # one is refused before anything is allocated): the same model resident.
    echo "--- the same, resident (no offload) ---" >>"$report"
    XTRAIN_KERNEL_CACHE="$out/kernel-cache" timeout 300 "$dir/xtrain" bench train \
        --preset medium --device cuda --steps 2 "${llama7b[@]}" \
        >>"$report" 2>&1 || echo "resident 7B: FAILED, refused or timed out" >>"$report"
    echo '```' >>"$report"
    cat "$report"
}

case "${1:-}" in
build) build ;;
run) shift; run "$@" ;;
offload) shift; offload "$@" ;;
*) echo "usage: scripts/gpu-check.sh build | run [OUT] | offload [OUT]" >&2; exit 2 ;;
esac
