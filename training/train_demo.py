"""Train the embedded demo model: a small Mixtral (8 experts, top-2) on the Python docs.

Self-contained: needs torch, transformers (5.17+), numpy and the committed files
training/data/tokens.npz and training/data/tokenizer/. Runs on CPU or CUDA (bf16 autocast).

    python training/train_demo.py --device cuda --steps 6000 --out /tmp/demo_ckpt
    python training/train_demo.py --device cpu --threads 2 --minutes 40 --out /work/demo_ckpt

With --steps the run is reproducible: the learning rate (warm-up, then cosine decay) depends
only on the step, the batches only on --seed. Without it, training stops after --minutes and
the decay follows the clock instead (a fallback for busy machines). Held-out loss is measured
every --eval-every steps; the best model so far is saved
(bf16 safetensors + config + tokenizer files + train_log.json) into --out.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import MixtralConfig, MixtralForCausalLM

DATA = Path(__file__).resolve().parent / "data"
SAMPLE_PROMPTS = ("What is a list in Python?", "What does `len` do?", "Hello")


@dataclass
class TrainArgs:
    device: str
    out: Path
    minutes: float
    steps: int | None
    seed: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int
    weight_decay: float
    eval_every: int
    eval_chunks: int
    threads: int | None
    data: Path
    init: Path | None = None


def demo_config(vocab_size: int) -> MixtralConfig:
    """The demo model's shape: 8 layers, hidden 256, 8 experts of 384, top-2 (~24M params)."""
    return MixtralConfig(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=384, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32, hidden_act="silu",
        max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
        num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.01,
        output_router_logits=False, tie_word_embeddings=False, sliding_window=None,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, initializer_range=0.02,
    )


def load_tokens(data: Path) -> dict[str, torch.Tensor]:
    with np.load(data / "tokens.npz") as z:
        return {k: torch.from_numpy(z[k].astype(np.int64)) for k in z.files}


def batches(stream: torch.Tensor, batch_size: int, seq_len: int, seed: int):
    """Endless [B, T+1] batches: each epoch, all windows at a random offset, shuffled."""
    rng = np.random.default_rng(seed)
    while True:
        offset = int(rng.integers(seq_len))
        n = (len(stream) - offset - 1) // seq_len
        starts = offset + seq_len * rng.permutation(n)
        for i in range(0, n - batch_size + 1, batch_size):
            idx = torch.as_tensor(starts[i:i + batch_size])[:, None] + torch.arange(seq_len + 1)
            yield stream[idx]


def lr_at(step: int, progress: float, args: TrainArgs) -> float:
    """Linear warm-up over args.warmup steps, then cosine decay to 10% as progress goes 0 -> 1."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def progress_of(step: int, elapsed: float, args: TrainArgs) -> float:
    """Fraction of the run done: by steps with --steps (reproducible), else by time."""
    if args.steps:
        return (step - args.warmup) / max(1, args.steps - args.warmup)
    return elapsed / (args.minutes * 60)


def autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, max_chunks: int | None,
                 device: torch.device) -> float:
    """Mean next-token loss over consecutive seq_len windows of the held-out stream."""
    model.eval()
    n = (len(stream) - 1) // seq_len
    if max_chunks:
        n = min(n, max_chunks)
    total, count = 0.0, 0
    for i in range(0, n, 8):
        k = min(8, n - i)
        idx = torch.arange(i, i + k)[:, None] * seq_len + torch.arange(seq_len + 1)
        x = stream[idx].to(device)
        with autocast(device):
            logits = model(input_ids=x[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / count


def save(model, args: TrainArgs, log: dict) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model).to("cpu", torch.bfloat16).save_pretrained(args.out)
    for f in (args.data / "tokenizer").iterdir():
        shutil.copy(f, args.out / f.name)
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1, default=str))


@torch.no_grad()
def print_samples(folder: Path, device: torch.device, prompts=SAMPLE_PROMPTS) -> None:
    """Greedy answers of the saved (best) model, as a first look at its quality."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    model = MixtralForCausalLM.from_pretrained(str(folder), dtype=torch.float32, trust_remote_code=False).to(device).eval()
    for p in prompts:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)
        out = model.generate(ids, max_new_tokens=60, do_sample=False,
                             eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        print(f"Q: {p}\nA: {tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)}\n",
              flush=True)


def train(args: TrainArgs) -> dict:
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else ("cpu" if args.device == "auto" else args.device))
    torch.manual_seed(args.seed)
    tokens = load_tokens(args.data)
    vocab = json.loads((args.data / "tokenizer" / "tokenizer.json").read_text())["model"]["vocab"]
    config = demo_config(len(vocab))
    if args.init:  # continue from a saved checkpoint's weights (fresh optimizer and schedule)
        model = MixtralForCausalLM.from_pretrained(str(args.init), dtype=torch.float32, trust_remote_code=False).to(device)
        config = model.config
    else:
        model = MixtralForCausalLM(config).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"device {device}, {n_params / 1e6:.2f}M parameters, "
          f"{len(tokens['train'])} training tokens", flush=True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")
    log = {"args": asdict(args), "config": config.to_dict(), "params": n_params,
           "train": [], "eval": [], "best": None}
    data = batches(tokens["train"], args.batch_size, args.seq_len, args.seed)
    total = args.steps or 10**9
    best = float("inf")
    start = time.time()
    step = 0
    while step < total:
        lr = lr_at(step, progress_of(step, time.time() - start, args), args)
        for g in opt.param_groups:
            g["lr"] = lr
        x = next(data).to(device, non_blocking=True)
        with autocast(device):
            out = model(input_ids=x[:, :-1], output_router_logits=True)
            logits = out.logits.float()  # [B, T, V]
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                               x[:, 1:].reshape(-1))
        loss = ce + config.router_aux_loss_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 10 == 0 or step == 1:
            elapsed = time.time() - start
            aux = out.aux_loss.item()
            row = {"step": step, "loss": round(ce.item(), 4), "aux": round(aux, 4),
                   "lr": lr, "s": round(elapsed, 1)}
            log["train"].append(row)
            tok_s = step * x.shape[0] * args.seq_len / elapsed
            print(f"step {step}{f'/{total}' if args.steps else ''} loss {row['loss']:.4f} aux {aux:.3f} "
                  f"lr {row['lr']:.2e} {tok_s:,.0f} tok/s {elapsed / 60:.1f} min", flush=True)
        out_of_time = args.steps is None and time.time() - start > args.minutes * 60
        if step % args.eval_every == 0 or step == total or out_of_time:
            val = heldout_loss(model, tokens["heldout"], args.seq_len, args.eval_chunks, device)
            log["eval"].append({"step": step, "heldout_loss": round(val, 4),
                                "s": round(time.time() - start, 1)})
            print(f"eval step {step}: held-out loss {val:.4f} (ppl {math.exp(val):.2f})",
                  flush=True)
            if val < best:
                best = val
                log["best"] = {"step": step, "heldout_loss": val}
                save(model, args, log)
        if out_of_time:
            print("time budget spent", flush=True)
            break
    log["seconds"] = round(time.time() - start, 1)
    log["steps_done"] = step
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1, default=str))
    print(f"done: {step} steps in {log['seconds'] / 60:.1f} min; best held-out loss "
          f"{best:.4f} (ppl {math.exp(best):.2f}) at step {log['best']['step']}; saved {args.out}")
    print_samples(args.out, device)
    return log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="auto", help="auto, cpu or cuda")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--minutes", type=float, default=8.0, help="time budget (without --steps)")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (then --minutes is unused)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=None, help="default: 64 on CUDA, 8 on CPU")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--eval-every", type=int, default=None, help="default: 250 CUDA, 100 CPU")
    ap.add_argument("--eval-chunks", type=int, default=None, help="held-out windows per eval")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--init", type=Path, default=None, help="start from this checkpoint's weights")
    a = ap.parse_args()
    cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    train(TrainArgs(
        device=a.device, out=a.out, minutes=a.minutes, steps=a.steps, seed=a.seed,
        batch_size=a.batch_size or (64 if cuda else 8), seq_len=a.seq_len, lr=a.lr,
        warmup=a.warmup, weight_decay=a.weight_decay,
        eval_every=a.eval_every or (250 if cuda else 100),
        eval_chunks=a.eval_chunks if a.eval_chunks is not None else (0 if cuda else 48),
        threads=a.threads, data=a.data, init=a.init))


if __name__ == "__main__":
    main()
