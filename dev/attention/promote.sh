#!/usr/bin/env bash
# Promotes the candidate attention kernels (attention_tc_next.cu, attention_tc_bwd_next.cu) into
# the library in a copy of the source tree, so that a whole xtrain built from it can be measured
# end to end beside the library's (scripts/gpu-check.sh builds it as .gpu-check/xtrain-next).
# The checkout itself is never changed:
#
#   dev/attention/promote.sh TREE      # TREE: a copy of this repository (e.g. a git worktree)
#
# In TREE: kernels/attention_tc.cu becomes the two candidates with their kernels renamed to
# the library's names (attn_fwd_tc_next_k4 -> attn_fwd_tc_k4, ...; the launchers, grids and
# arguments are the same: bf16 Q, K, V, dO), and promote-ops.patch gives the launchers the
# candidates' dynamic shared memory (512 (D + 8) bytes for the forward and dQ, 512 (D + 8) + 512
# for dK/dV: their double-buffered tiles). The patch is applied with `git apply`, which refuses
# a tree whose ops.rs has moved on: then regenerate it (make the two edits in a worktree,
# `git diff > dev/attention/promote-ops.patch`).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
tree=${1:?usage: dev/attention/promote.sh TREE}
kernels="$tree/crates/tensor/src/cuda/kernels/attention_tc.cu"
[ -f "$kernels" ] || { echo "promote.sh: $kernels not found" >&2; exit 1; }
{
    echo "// The candidate kernels of dev/attention, promoted by dev/attention/promote.sh."
    sed 's/_tc_next_k/_tc_k/g' "$here/attention_tc_next.cu"
    sed 's/_tc_next_k/_tc_k/g' "$here/attention_tc_bwd_next.cu"
} >"$kernels"
for k in attn_fwd_tc_k4 attn_fwd_tc_k8 attn_bwd_dq_tc_k4 attn_bwd_dq_tc_k8 attn_bwd_dkv_tc_k4 attn_bwd_dkv_tc_k8; do
    grep -q "$k" "$kernels" || { echo "promote.sh: no kernel $k after renaming" >&2; exit 1; }
done
# git apply run inside another repository's working tree (a copy under this checkout's target/,
# as scripts/gpu-check.sh makes) takes paths relative to that repository's root and silently
# skips the ones outside the current folder: stop the search for a repository at the tree's
# parent, and check that the launchers did change.
ops="$tree/crates/tensor/src/cuda/ops.rs"
before=$(cksum <"$ops")
tree_abs=$(cd "$tree" && pwd)
(cd "$tree_abs" && GIT_CEILING_DIRECTORIES="$(dirname "$tree_abs")" git apply "$here/promote-ops.patch")
[ "$(cksum <"$ops")" != "$before" ] || { echo "promote.sh: promote-ops.patch changed nothing in $ops" >&2; exit 1; }
echo "promoted the candidate attention kernels in $tree"
