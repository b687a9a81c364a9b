"""Runs the wgmma attention forward prototype (attn_fwd.cu) on a Hopper GPU: checks it against
PyTorch's attention and times it beside PyTorch's own (scaled_dot_product_attention, bf16,
causal) at the 124M's shape — what Hopper's warpgroup products give before the library takes
them (docs/GPU.md, "What comes next"). Compare its TFLOP/s with `xtrain bench kernels`'s
forward at the same shape (the check's bench section).

`python3 dev/wgmma/attn_fwd.py` on the GPU machine (as probe.py: PyTorch, NVRTC and the driver
through ctypes). V's descriptor offsets come from probe.py's sweep (mode 2). Exits 0 after a
run whatever it finds (a probe), 2 where there is no Hopper GPU.
"""
import ctypes
import math
import sys

import torch
import torch.nn.functional as F

import probe


def run(cu, fn, q, k, v, out, lse, vlbo, vsbo):
    """The prototype on q, k, v (bf16 [B, S, H, 64]) into out (fp32 [B, S, H, 64]) and lse
    (fp32 [B, H, S])."""
    B, S, H, D = q.shape
    probe.launch(cu, fn, ((S + 63) // 64, B * H, 1), (128, 1, 1), 41 * 1024,
                 [ctypes.c_void_p(q.data_ptr()), ctypes.c_void_p(k.data_ptr()),
                  ctypes.c_void_p(v.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                  ctypes.c_void_p(lse.data_ptr()), ctypes.c_int(B), ctypes.c_int(S),
                  ctypes.c_int(H), ctypes.c_float(1.0 / math.sqrt(D)), ctypes.c_int(vlbo),
                  ctypes.c_int(vsbo)], "attn_fwd_wgmma")


def reference(q, k, v):
    """fp32 attention of the bf16 values: out [B, S, H, D], lse [B, H, S]."""
    qf, kf, vf = (x.float().transpose(1, 2) for x in (q, k, v))  # [B, H, S, D]
    S = q.shape[1]
    s = qf @ kf.transpose(-1, -2) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(S, S, device="cuda", dtype=torch.bool).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ vf).transpose(1, 2), torch.logsumexp(s, -1)


def median_ms(f, reps=20):
    f()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def main():
    if not probe.hopper():
        print("attn_fwd: no Hopper GPU (sm_90)")
        return 2
    cu = ctypes.CDLL("libcuda.so.1")
    nvrtc = probe.load_nvrtc()
    good = probe.sweep(cu, probe.function(cu, probe.compile_cubin(nvrtc), "probe"), 2,
                       quiet=True)
    if not good:
        print("attn_fwd: no descriptor offsets give P V (probe.py mode 2): not run")
        return 0
    vlbo, vsbo = good[0]
    fn = probe.function(cu, probe.compile_cubin(nvrtc, "attn_fwd.cu"), "attn_fwd_wgmma")
    torch.manual_seed(0)
    # Correctness on ragged shapes, then the 124M's (batch 8, 12 heads, head 64, seq 1024).
    for B, S, H in ((1, 200, 2), (2, 130, 3), (8, 1024, 12)):
        q, k, v = (torch.randn(B, S, H, 64, device="cuda").to(torch.bfloat16) for _ in range(3))
        out = torch.full((B, S, H, 64), float("nan"), device="cuda")
        lse = torch.full((B, H, S), float("nan"), device="cuda")
        run(cu, fn, q, k, v, out, lse, vlbo, vsbo)
        probe.check(cu.cuCtxSynchronize(), "attn_fwd_wgmma")
        ro, rl = reference(q, k, v)
        err = ((out - ro).abs().max() / ro.abs().max()).item()
        lerr = (lse - rl).abs().max().item()
        ok = err < 1e-2 and lerr < 1e-3
        print(f"attn_fwd_wgmma B{B} S{S} H{H} D64 causal (V lbo {vlbo}, sbo {vsbo}): out "
              f"{err:.2e} of max, lse {lerr:.2e}{'  OK' if ok else '  MISMATCH'}", flush=True)
    flops = 4 * B * H * S * S * 64 / 2
    ms = median_ms(lambda: run(cu, fn, q, k, v, out, lse, vlbo, vsbo))
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    ms_t = median_ms(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True))
    print(f"forward B{B} S{S} H{H} D64 causal: wgmma prototype {ms:.3f} ms "
          f"({flops / ms / 1e9:.0f} TFLOP/s), PyTorch sdpa {ms_t:.3f} ms "
          f"({flops / ms_t / 1e9:.0f} TFLOP/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
