#!/usr/bin/env python3
"""Reference numbers from Hugging Face transformers for `crates/model/tests/golden.rs`.

For each tiny configuration below: a randomly initialised LlamaForCausalLM or
MixtralForCausalLM (fp32, eager attention) on a random batch gives the logits, the loss, every
parameter's gradient, and the losses and weights of 3 AdamW steps on the same batch. Written to
tests/data/golden/NAME.safetensors (weights under their Hugging Face names, `grad.NAME`,
`step3.NAME`, `input_ids`, `logits`) and NAME.json (the config, the conventions, the losses).

    pip install torch transformers safetensors
    python3 dev/golden/make_goldens.py                     # every configuration
    python3 dev/golden/make_goldens.py llama_tied_rope3    # one

Tied embeddings: the one shared tensor is saved once, as `model.embed_tokens.weight`, and its
gradient is the sum of both uses (the embedding lookup and the LM head). `hf_config` in the
JSON is the config as this transformers version writes it (transformers 5 writes
`rope_parameters` where 4 wrote `rope_theta` and `rope_scaling`): the test parses both forms.
"""
import argparse
import json
import pathlib

import torch
import transformers
from safetensors.torch import save_file

OUT = pathlib.Path(__file__).resolve().parents[2] / "tests" / "data" / "golden"

BASE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=176,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)
MOE = dict(num_local_experts=4, num_experts_per_tok=2)
# Llama 3's frequency scaling with an original length small enough for head_dim 16 to have
# wavelengths in all three bands (2π·θ^(2i/16): 6.3 … 19869 against 256/4 and 256).
LLAMA3 = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=256,
)
CONFIGS = {
    "llama_tiny": ("llama", dict(BASE)),
    "mixtral_tiny": ("mixtral", dict(BASE, **MOE)),
    "llama_tied_rope3": ("llama", dict(BASE, tie_word_embeddings=True, rope_scaling=LLAMA3)),
    "mixtral_tied_rope3": (
        "mixtral",
        dict(BASE, **MOE, tie_word_embeddings=True, rope_scaling=LLAMA3),
    ),
}
BATCH, SEQ = 2, 16
ADAMW = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, steps=3)


def hf_config(arch, cfg):
    """The transformers config object for our (transformers 4 style) config dict."""
    kw = dict(cfg, max_position_embeddings=512, attn_implementation="eager")
    major = int(transformers.__version__.split(".")[0])
    scaling = kw.pop("rope_scaling", None)
    if major >= 5:
        kw["rope_parameters"] = dict(scaling or {"rope_type": "default"}, rope_theta=kw.pop("rope_theta"))
    elif scaling is not None:
        kw["rope_scaling"] = scaling
    if arch == "llama":
        return transformers.LlamaConfig(**kw)
    return transformers.MixtralConfig(output_router_logits=False, **kw)


def make(name):
    arch, cfg = CONFIGS[name]
    torch.manual_seed(0)
    conf = hf_config(arch, cfg)
    cls = transformers.LlamaForCausalLM if arch == "llama" else transformers.MixtralForCausalLM
    model = cls(conf).float().train(False)
    ids = torch.randint(0, cfg["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))

    # Unique tensors under their first name (tied: lm_head.weight is embed_tokens.weight).
    named, seen = [], set()
    for n, p in model.named_parameters(remove_duplicate=True):
        if id(p) not in seen:
            seen.add(id(p))
            named.append((n, p))
    tensors = {n: p.detach().clone().contiguous() for n, p in named}

    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    tensors["logits"] = out.logits.detach().contiguous()
    tensors["loss"] = out.loss.detach().reshape(1)
    tensors["input_ids"] = ids.to(torch.int64)
    for n, p in named:
        tensors[f"grad.{n}"] = p.grad.detach().clone().contiguous()
    loss0 = out.loss.item()

    model.zero_grad(set_to_none=True)
    steps = ADAMW["steps"]
    opt = torch.optim.AdamW(
        [p for _, p in named],
        lr=ADAMW["lr"],
        betas=ADAMW["betas"],
        eps=ADAMW["eps"],
        weight_decay=ADAMW["weight_decay"],
    )
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
    for n, p in named:
        tensors[f"step{steps}.{n}"] = p.detach().clone().contiguous()
    tensors["adamw_losses"] = torch.tensor(losses)

    OUT.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(OUT / f"{name}.safetensors"))
    meta = {
        "source": f"transformers {cls.__name__} {transformers.__version__}, torch {torch.__version__}, "
        "fp32, eager attention" + (" (no aux loss in the loss)" if arch == "mixtral" else ""),
        "config": cfg,
        "hf_config": json.loads(conf.to_json_string()),
        "batch": BATCH,
        "seq": SEQ,
        "loss_convention": "mean cross-entropy of logits[:, t] against input_ids[:, t+1] over t < seq-1",
        "adamw": dict(
            ADAMW,
            betas=list(ADAMW["betas"]),
            note="same batch every step; decoupled weight decay on every parameter incl. norms; "
            "torch.optim.AdamW defaults otherwise",
        ),
        "loss": loss0,
        "adamw_losses": losses,
        "notes": "weights use Hugging Face names and layouts: nn.Linear weights are [out, in]; "
        "'grad.<name>' holds d loss / d <name>; 'step<k>.<name>' the weights after k AdamW steps "
        "on the same batch; 'adamw_losses' the loss before each step. Tied embeddings: one tensor, "
        "model.embed_tokens.weight, whose gradient sums the lookup's and the LM head's.",
    }
    (OUT / f"{name}.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(f"{name}: loss {loss0:.6f}, adamw {losses}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", choices=[[], *CONFIGS], help="configurations (default: all)")
    args = ap.parse_args()
    for name in args.names or CONFIGS:
        make(name)


if __name__ == "__main__":
    main()
