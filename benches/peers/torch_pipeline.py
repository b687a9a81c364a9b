"""PyTorch peer of xtrain's pipeline-parallel benchmark (`xtrain bench train --pp 2`):
`torch.distributed.pipelining` with the gloo backend on CPU, 2 processes (spawned by this
script) of 1 thread each, fp32, measured like `xtrain bench train` (one warm-up step, then the
median of the timed steps; GFLOP/s by 6N + 12·L·H·S with N = all parameters).

The model is transformers' LlamaForCausalLM (sdpa attention, causal, RoPE theta 10000, untied
head, init std 0.02) at the `small` preset's shape with 8 layers (vocab 256, hidden 256, ffn 688,
8 heads, 4 KV heads, seq 256), built whole on both ranks from one seed and cut by hand into two
stages as torchtitan does: stage 0 = embed_tokens + layers[0:4], stage 1 = layers[4:8] + norm +
lm_head; each stage computes the rotary embeddings itself. A step is 8 micro-batches of 1
sequence (2048 tokens): `schedule.step` (1F1B or GPipe; the loss is next-token cross-entropy,
mean per micro-batch, and the schedule scales the gradients by 1/8), gradient clipping at 1.0
over both stages' parameters (the squared norms summed across the ranks by an all_reduce),
AdamW (lr 3e-4, weight decay 0.1), zero_grad. A step's time is the slowest rank's, from a
barrier. The last rank prints the loss of the first step (≈ ln 256 = 5.545 at initialisation)
next to the unsplit model's loss on the same batch.

    pip install torch transformers
    python3 benches/peers/torch_pipeline.py --schedule 1f1b --steps 6
    python3 benches/peers/torch_pipeline.py --schedule gpipe --steps 6
    xtrain bench train --preset small --pp 2 --microbatches 8 --schedule 1f1b \
        --set train.micro_batch=1 --set model.num_layers=8 --threads 1 --steps 6
"""

import argparse
import math
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

# The `small` preset with 8 layers: (vocab, hidden, ffn, layers, heads, kv heads, seq).
VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, SEQ = 256, 256, 688, 8, 8, 4, 256
STAGES = 2
MICROBATCHES = 8  # of 1 sequence each
SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


class Stage(nn.Module):
    """A contiguous slice of a LlamaForCausalLM: the embedding if first, some decoder layers,
    the final norm and the head if last; the rotary embeddings are computed here."""

    def __init__(self, model, config, lo, hi, first, last):
        super().__init__()
        self.embed_tokens = model.model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.model.layers[lo:hi])
        self.norm = model.model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = LlamaRotaryEmbedding(config)

    def forward(self, x):
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        position_embeddings = self.rotary_emb(h, position_ids)
        for layer in self.layers:
            # attention_mask None: sdpa with is_causal=True
            h = layer(h, position_ids=position_ids, position_embeddings=position_embeddings)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


def next_token_loss(logits, target):
    """LlamaForCausalLM's loss: position t predicts token t+1, mean over the micro-batch."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), target[:, 1:].reshape(-1))


def worker(rank, args, port):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=STAGES)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=SEQ,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        initializer_range=0.02,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).float().train()  # same seed on both ranks: same weights
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, VOCAB, (MICROBATCHES, SEQ))
    first, last = rank == 0, rank == STAGES - 1
    if last:
        with torch.no_grad():
            reference_loss = model(input_ids=ids, labels=ids).loss.item()
    per_stage = LAYERS // STAGES
    stage_module = Stage(model, config, rank * per_stage, (rank + 1) * per_stage, first, last)
    del model
    stage = PipelineStage(stage_module, rank, STAGES, torch.device("cpu"))
    schedule = SCHEDULES[args.schedule](stage, MICROBATCHES, loss_fn=next_token_loss)
    params = list(stage_module.parameters())
    opt = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1)

    def step():
        dist.barrier()
        t0 = time.perf_counter()
        losses = []
        if first:
            schedule.step(ids)
        else:
            schedule.step(target=ids, losses=losses, return_outputs=False)
        # clip at 1.0 by the norm over both stages' parameters
        grads = [p.grad for p in params if p.grad is not None]
        sq = torch.stack(torch._foreach_norm(grads)).pow(2).sum()
        dist.all_reduce(sq)
        coef = torch.clamp(1.0 / (sq.sqrt() + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef)
        opt.step()
        opt.zero_grad(set_to_none=True)
        dt = torch.tensor(time.perf_counter() - t0, dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)  # the slowest rank's time
        return dt.item(), losses, sq.sqrt().item()

    _, losses, norm = step()  # warm-up (also infers the stages' shapes)
    if last:
        loss = torch.stack(losses).mean().item()
        print(
            f"first step: loss {loss:.4f} (mean of {len(losses)} micro-batches; ln {VOCAB} = "
            f"{math.log(VOCAB):.4f}; unsplit LlamaForCausalLM on the same batch {reference_loss:.4f}), "
            f"gradient norm {norm:.3f}",
            flush=True,
        )
    times = [step()[0] for _ in range(max(args.steps, 1))]
    if last:
        median = statistics.median(times)
        tokens = MICROBATCHES * SEQ
        flops_per_token = 6 * n_params + 12 * LAYERS * HIDDEN * SEQ
        print(
            f"torch {torch.__version__} pipeline {args.schedule} pp={STAGES} m={MICROBATCHES} "
            f"(small, {LAYERS} layers, {n_params} params, gloo, {STAGES} × 1 thread): "
            f"median step {median:.4f} s -> {tokens / median:.0f} tokens/s, "
            f"FLOPs/token {flops_per_token:.3e} -> {flops_per_token * tokens / median / 1e9:.1f} GFLOP/s "
            f"(steps {', '.join(f'{t:.4f}' for t in times)})",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    ap.add_argument("--steps", type=int, default=6, help="timed steps after one warm-up step")
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(worker, args=(args, free_port()), nprocs=STAGES, join=True)


if __name__ == "__main__":
    main()
