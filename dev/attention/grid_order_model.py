"""A list-scheduling model of the order in which a causal attention kernel's blocks start,
for the tensor-core kernels' grid (crates/tensor/src/cuda/kernels/attention_tc.cu, f.):
`python3 dev/attention/grid_order_model.py` prints, for the 124M's shape and a few others,
the time the grid takes in units of one key tile's work when the blocks start in the order of
their linear index as slots free up, against the work's ideal (total work / slots).

The model: every block slot of the GPU (SMs x blocks an SM) takes the next block as soon as
its block ends; a block's time is its number of key tiles (forward and dQ: query block i of
a head sees i + 1 tiles of 64 keys; dK/dV: key block j is seen by the query steps from its
own on, 2 (n - j) steps of 32 rows). No memory effects, no tail of partial waves within a
block. Two orders of the same blocks:
  per head:  grid (blocks, heads), x fastest: each head's blocks longest first, head after head
             (the kernels' order before);
  global:    grid (heads, blocks): every head's longest block first, then every head's next
             (the kernels' order now: FlashAttention-3's "longest processing time first").
"""
import heapq


def makespan(durations, slots):
    """The time a list schedule of `durations`, in this order, takes on `slots` slots."""
    free = [0] * slots
    end = 0
    for d in durations:
        t = heapq.heappop(free)
        heapq.heappush(free, t + d)
        end = max(end, t + d)
    return end


def compare(name, heads, work, slots):
    """`work`: each block's time, longest first, for one head."""
    per_head = [w for _ in range(heads) for w in work]
    global_ = [w for w in work for _ in range(heads)]
    ideal = sum(per_head) / slots
    a, b = makespan(per_head, slots), makespan(global_, slots)
    print(f"{name}: {heads} heads x {len(work)} blocks on {slots} slots: per head "
          f"{a} ({a / ideal:.2f}x the ideal {ideal:.1f}), global {b} ({b / ideal:.2f}x)")


if __name__ == "__main__":
    n = 16  # blocks of 64 rows in a sequence of 1024
    fwd = [n - i for i in range(n)]  # query block n - 1 first: n key tiles
    dkv = [2 * (n - j) for j in range(n)]  # key block 0 first: 2n query steps
    # 124M: batch 8 x 12 heads; 132 SMs (H100 / H200) x 3 blocks (the k4 kernels' registers).
    compare("124M forward / dQ", 96, fwd, 396)
    compare("124M dK/dV", 96, dkv, 396)
    # ~1B: batch 4 x 16 heads at head 128, 2 blocks an SM (the k8 kernels).
    compare("1B forward / dQ", 64, fwd, 264)
    compare("1B dK/dV", 64, dkv, 264)
    # A100: 108 SMs x 3.
    compare("124M forward / dQ, A100", 96, fwd, 324)
