"""PyTorch peers of xtrain's benchmarks, measured the same way so that both can be run
alternately in one session on one machine and compared as a ratio:

- `train`: eager CPU training steps of transformers' LlamaForCausalLM (sdpa attention, fp32,
  AdamW, gradient clipping at 1.0) on the trainer presets, like `xtrain bench train` (one
  warm-up step, then the median of the timed steps; GFLOP/s by 6N + 12·L·H·S with N = all
  parameters).
- `gemm`: fp32 `torch.mm` of n × n × n, median of 7 (like `cpu_throughput gemm`).
- `attention`: causal `scaled_dot_product_attention` forward and backward at batch 8, 8 heads,
  head dim 32, sequence 256 (the tensor-core issue's shape), median of 7; FLOPs counted as in
  `cpu_throughput attention` (the causal half: 2·b·h·s²·d forward, 2.5× that backward).

On a GPU (`--device cuda`): the same training step on the device, fp32 with TF32 off (what
`xtrain bench train --device cuda` runs today) or `--dtype bf16` (bf16 weights), fused AdamW,
timed with `torch.cuda.synchronize()` around each step; `--compile` wraps the model in
`torch.compile` (default mode; the warm-up steps, which compile, are not timed). `--profile`
runs one more step under `torch.profiler` and prints its device time by kind (products,
attention, optimizer, the rest) and its costliest kernels: the peer's side of the per-kernel
comparison `xtrain bench train --device cuda` prints for xtrain.

    pip install torch transformers
    python3 benches/peers/torch_peer.py train --preset small --threads 1 --steps 4
    python3 benches/peers/torch_peer.py train --preset small --device cuda --steps 10
    python3 benches/peers/torch_peer.py train --preset medium --device cuda --dtype bf16 --compile
    python3 benches/peers/torch_peer.py gemm --threads 2 --n 2048
    python3 benches/peers/torch_peer.py attention --threads 2
"""

import argparse
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# The trainer issue's presets: (vocab, hidden, ffn, layers, heads, kv heads, seq, batch).
PRESETS = {
    "tiny": (256, 64, 176, 2, 4, 2, 64, 8),
    "small": (256, 256, 688, 6, 8, 4, 256, 8),
    "medium": (4096, 512, 1376, 8, 8, 4, 512, 4),
}


def median_time(f, reps=7):
    f()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm(args):
    n = args.n
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = median_time(lambda: torch.mm(a, b))
    print(f"torch {torch.__version__} gemm {n}³, {args.threads} thread(s): {2 * n**3 / t / 1e9:.1f} GFLOP/s")


def attention(args):
    b, h, kv, d, s = (int(x) for x in args.shape.split(","))
    q = torch.randn(b, h, s, d, requires_grad=True)
    k, v = (torch.randn(b, kv, s, d, requires_grad=True) for _ in range(2))
    dout = torch.randn(b, h, s, d)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fwd_flops = 2 * b * h * s * s * d  # causal half of 4·b·h·s²·d
    gqa = {"enable_gqa": True} if kv != h else {}
    with torch.no_grad():
        t_fwd = median_time(lambda: sdpa(q, k, v, is_causal=True, **gqa))

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        sdpa(q, k, v, is_causal=True, **gqa).backward(dout)

    t_both = median_time(fwd_bwd)
    t_bwd = t_both - t_fwd
    print(
        f"torch {torch.__version__} sdpa b{b} h{h} kv{kv} d{d} s{s} causal, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, {args.threads} thread(s), "
        f"GFLOP/s: fwd {fwd_flops / t_fwd / 1e9:.1f}, bwd {2.5 * fwd_flops / t_bwd / 1e9:.1f} "
        f"(bwd = fwd+bwd time minus fwd time)"
    )


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["train", "gemm", "attention"])
    ap.add_argument("--preset", choices=PRESETS, default="small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--n", type=int, default=2048)
    ap.add_argument("--device", default="cpu", help="train: cpu or cuda")
    ap.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="train on cuda")
    ap.add_argument("--compile", action="store_true", help="train: torch.compile the model")
    ap.add_argument("--profile", action="store_true",
                    help="train on cuda: device time of one more step by kind and by kernel")
    ap.add_argument("--shape", default="8,8,8,32,256",
                    help="attention: batch,heads,kv_heads,head_dim,seq (medium preset: 4,8,4,64,512)")
    ap.add_argument("--model", default=None,
                    help="train: vocab,hidden,ffn,layers,heads,kv_heads,seq,batch instead of the preset "
                         "(xtrain's --set model.* / train.micro_batch overrides of the same shape)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.what == "gemm":
        return gemm(args)
    if args.what == "attention":
        return attention(args)
    if args.model:
        vocab, hidden, ffn, layers, heads, kv, seq, batch = map(int, args.model.split(","))
    else:
        vocab, hidden, ffn, layers, heads, kv, seq, batch = PRESETS[args.preset]
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=seq,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    cuda = args.device.startswith("cuda")
    if cuda:
        # fp32 parity with xtrain's fp32 GPU path: no TF32 in matrix products.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = LlamaForCausalLM(cfg).to(device=args.device, dtype=dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=cuda)
    n_params = sum(p.numel() for p in model.parameters())
    if args.compile:
        model = torch.compile(model)
    ids = torch.randint(0, vocab, (batch, seq), device=args.device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def step():
        sync()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    for _ in range(3 if args.compile else 1):
        step()  # warm-up (with --compile: compilation, and its recompilations)
    median = statistics.median(step() for _ in range(max(args.steps, 1)))
    tokens = batch * seq
    flops_per_token = 6 * n_params + 12 * layers * hidden * seq
    print(
        f"torch {torch.__version__}{' compiled' if args.compile else ''} "
        f"preset {args.model or args.preset} ({n_params} params), "
        f"{torch.cuda.get_device_name() + ' ' + args.dtype if cuda else str(args.threads) + ' thread(s)'}: "
        f"median step {median:.4f} s -> {tokens / median:.0f} tokens/s, "
        f"{flops_per_token * tokens / median / 1e9:.1f} GFLOP/s"
    )
    if args.profile and cuda:
        profile_step(step)


# What a kernel's name says it is, for the by-kind summary (cuBLAS / CUTLASS products, the
# flash / memory-efficient attention kernels, the fused AdamW); the first match wins.
KINDS = [
    ("products", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "sm80_")),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
]


def profile_step(step, top=25):
    """One training step under torch.profiler: its device time by kind and its `top` costliest
    kernels (total milliseconds, launches). A failure is printed, never raised: the timing
    above stands without it."""
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "self_device_time_total", None)
            if t is None:
                t = getattr(e, "self_cuda_time_total", 0)
            if t > 0:
                rows.append((t / 1000.0, e.count, e.key))
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        by_kind = {}
        for ms, _, name in rows:
            low = name.lower()
            kind = next((k for k, keys in KINDS if any(x in low for x in keys)), "other")
            by_kind[kind] = by_kind.get(kind, 0.0) + ms
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(by_kind.items(), key=lambda x: -x[1]))
        print(f"torch profile of one step: device time {total:.2f} ms ({kinds})")
        for ms, count, name in rows[:top]:
            print(f"  {ms:8.3f} ms {count:5d}x  {name[:110]}")
    except Exception as e:  # noqa: BLE001 - any profiler failure only loses the breakdown
        print(f"torch profile failed: {type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
