#!/usr/bin/env python3
"""nanoGPT's training recipe in PyTorch, on the data `mtrain prepare` wrote, logging as `mtrain` does.

The reference the binary's learning is compared with (scripts/shakespeare-char.sh runs both):
  python3 torch_nanogpt_ref.py --data data/shakespeare_char --out runs/shakespeare-torch      # one GPU
  python3 torch_nanogpt_ref.py --data DIR --out DIR --device cpu --steps 20 --layers 2 ...   # a check on CPU

What it does, each part as nanoGPT's train.py does it:
  data      DIR/train_*.bin and DIR/val_*.bin (mtrain's shards: little-endian u16/u32 ids, a JSON header
            beside each), the shards of a split joined; a batch is B rows at offsets drawn uniformly
            (torch.randint over len - T, get_batch's rule) from a generator seeded with --seed
  model     learned token and position embeddings, dropout after them; pre-LayerNorm blocks: causal
            attention (dropout on the attention probabilities, SDPA's dropout_p, and on its output
            projection) and a 4x MLP (dropout on its output); final LayerNorm; LM head tied to the token
            embedding. Biases on and the tanh GELU, as mtrain's GPT (nanoGPT's shakespeare_char has
            bias=False and the erf GELU); init N(0, 0.02), output projections 0.02/sqrt(2L), biases 0
  optimizer AdamW (beta1 0.9, --beta2, eps 1e-8), weight decay on the >= 2-D tensors only, the global
            gradient norm clipped to --clip; lr: linear warmup lr*(s+1)/(warmup+1), then cosine to
            --min-lr at --steps (mtrain's lr_at, the same formula as nanoGPT's get_lr)
  eval      after step s when (s+1) % eval_every == 0 and at the last step: the mean loss of eval_iters
            random batches of each split with dropout off (estimate_loss)
  compute   bf16 autocast on CUDA (nanoGPT's dtype), fp32 on CPU

Two options put the reference on mtrain's own footing, to tell the training apart from the draws:
  --init-from RUN/step-N/rank-00000.safetensors   start from a one-rank mtrain run's checkpoint
                                             weights (needs the safetensors package)
  --mtrain-batches                           draw every row, training and evaluation, as mtrain does
                                             (Philox4x32-10 keyed by the seed, crates/trainer/src/data/
                                             sampling.rs; one shard per split)
With both, a run takes exactly mtrain's steps: the losses agree to float rounding.

Writes OUT/metrics.jsonl with mtrain's keys (step, run, loss, lr, grad_norm, step_ms, tokens_per_s, mfu,
epoch, train_eval_loss, val_loss) so `mtrain plot OUT` draws it, and prints mtrain's step line.
"""
import argparse, array, json, math, os, sys, time
import torch, torch.nn as nn, torch.nn.functional as F


def read_split(d, name):
    """The tokens of every `name`_*.bin shard in `d`, joined, and the headers' vocabulary size."""
    bins = sorted(f for f in os.listdir(d) if f.startswith(name + "_") and f.endswith(".bin"))
    if not bins:
        raise SystemExit(f"{d}: no {name}_*.bin shards (write them with `mtrain prepare`)")
    parts, vocab = [], None
    for b in bins:
        h = json.load(open(os.path.join(d, b[:-4] + ".json")))
        a = array.array({"u16": "H", "u32": "I"}[h["dtype"]])
        with open(os.path.join(d, b), "rb") as f:
            a.frombytes(f.read())
        if sys.byteorder != "little":
            a.byteswap()
        if len(a) != h["n_tokens"]:
            raise SystemExit(f"{b}: {len(a)} tokens, the header says {h['n_tokens']}")
        parts.append(torch.tensor(a, dtype=torch.int64))
        vocab = h["vocab_size"]
    return torch.cat(parts), vocab


class Attention(nn.Module):
    def __init__(s, C, H, p):
        super().__init__()
        s.H, s.p = H, p
        s.c_attn, s.c_proj = nn.Linear(C, 3 * C), nn.Linear(C, C)
        s.resid_drop = nn.Dropout(p)

    def forward(s, x):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, s.H, C // s.H).transpose(1, 2) for t in s.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=s.p if s.training else 0.0, is_causal=True)
        return s.resid_drop(s.c_proj(y.transpose(1, 2).reshape(B, T, C)))


class Block(nn.Module):
    def __init__(s, C, H, p):
        super().__init__()
        s.ln_1, s.attn, s.ln_2 = nn.LayerNorm(C), Attention(C, H, p), nn.LayerNorm(C)
        s.c_fc, s.c_proj, s.drop = nn.Linear(C, 4 * C), nn.Linear(4 * C, C), nn.Dropout(p)

    def forward(s, x):
        x = x + s.attn(s.ln_1(x))
        return x + s.drop(s.c_proj(F.gelu(s.c_fc(s.ln_2(x)), approximate="tanh")))


class GPT(nn.Module):
    def __init__(s, V, T, L, H, C, p):
        super().__init__()
        s.wte, s.wpe, s.drop = nn.Embedding(V, C), nn.Embedding(T, C), nn.Dropout(p)
        s.blocks = nn.ModuleList(Block(C, H, p) for _ in range(L))
        s.ln_f = nn.LayerNorm(C)
        for name, w in s.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(w)
            elif w.dim() == 2:
                nn.init.normal_(w, std=0.02 / (math.sqrt(2 * L) if name.endswith("c_proj.weight") else 1.0))

    def forward(s, idx, targets):
        x = s.drop(s.wte(idx) + s.wpe(torch.arange(idx.shape[1], device=idx.device)))
        for b in s.blocks:
            x = b(x)
        logits = s.ln_f(x) @ s.wte.weight.t()  # (B, T, V)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


M32 = 0xFFFFFFFF


def philox4x32(c, k):
    """Philox4x32-10 of counter c (4 words) under key k (2 words), as mtrain_kernels::philox."""
    for rnd in range(10):
        if rnd:
            k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k[0]) & M32, p1 & M32, ((p0 >> 32) ^ c[3] ^ k[1]) & M32, p0 & M32]
    return c


def mtrain_row_start(seed, split_id, evaluation, step, row, n_starts):
    """The start mtrain draws for `row` of step `step`'s batch (one shard: the second draw alone)."""
    stream = 2 * split_id + int(evaluation)
    w = philox4x32([row & M32, row >> 32, step & M32, ((step >> 32) & 0xFFFFFF) | stream << 24],
                   [seed & M32, seed >> 32])
    return ((w[2] | w[3] << 32) * n_starts) >> 64


def load_mtrain_weights(model, path):
    """An mtrain checkpoint's tensors into `model` (h.i -> blocks.i; the MLP's names one level up).

    `path`: a one-rank run's shard file (RUN/step-N/rank-00000.safetensors: every weight whole, as
    a flat "w.<name>", reshaped here), or an older checkpoint's model.safetensors."""
    from safetensors.torch import load_file
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    sd = {}
    for k, v in load_file(path).items():
        if k.startswith(("m.", "v.")):
            continue  # optimizer moments
        k = k[2:] if k.startswith("w.") else k
        k = "blocks." + k[2:] if k.startswith("h.") else k
        k = k.replace(".mlp.", ".")
        sd[k] = v.reshape(shapes[k]) if k in shapes else v
    model.load_state_dict(sd, strict=True)


def lr_at(step, a):
    if step < a.warmup:
        return a.lr * (step + 1) / (a.warmup + 1)
    if step >= a.steps or a.steps <= a.warmup:
        return a.min_lr
    r = (step - a.warmup) / (a.steps - a.warmup)
    return a.min_lr + 0.5 * (1.0 + math.cos(math.pi * r)) * (a.lr - a.min_lr)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="a directory written by `mtrain prepare`")
    p.add_argument("--out", required=True, help="run directory: metrics.jsonl goes there")
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--seq", type=int, default=256, help="tokens per row (and the model's block size)")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--width", type=int, default=384)
    p.add_argument("--vocab", type=int, default=0, help="model vocabulary (0: the data's, padded to a multiple of 64, as mtrain)")
    p.add_argument("--dropout", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0, help="global gradient norm clip (0: off)")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=250)
    p.add_argument("--eval-iters", type=int, default=200)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="", choices=["", "bf16", "fp32"], help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="CPU: intra-op threads (0: PyTorch's default)")
    p.add_argument("--run", default="torch-nanogpt", help="the run id written into every metrics line")
    p.add_argument("--init-from", default="", help="a one-rank mtrain checkpoint's rank-00000.safetensors")
    p.add_argument("--mtrain-batches", action="store_true", help="draw rows as mtrain does (see above)")
    a = p.parse_args()
    cuda = a.device == "cuda"
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = a.dtype or ("bf16" if cuda else "fp32")
    torch.manual_seed(a.seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    dev = torch.device(a.device)

    train, data_vocab = read_split(a.data, "train")
    val, _ = read_split(a.data, "val")
    V = a.vocab or (data_vocab + 63) // 64 * 64
    if min(len(train), len(val)) <= a.seq:
        raise SystemExit(f"a split has at most {min(len(train), len(val))} tokens, no row of {a.seq + 1}")
    model = GPT(V, a.seq, a.layers, a.heads, a.width, a.dropout)
    if a.init_from:
        load_mtrain_weights(model, a.init_from)
    model = model.to(dev)
    n_params = sum(w.numel() for w in model.parameters())
    decay = [w for w in model.parameters() if w.dim() >= 2]
    no_decay = [w for w in model.parameters() if w.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr, betas=(0.9, a.beta2), eps=1e-8, **({"fused": True} if cuda else {}))
    fwd = torch.compile(model) if a.compile else model
    gen = torch.Generator().manual_seed(a.seed)

    def get_batch(split, step=0, micro=0, evaluation=False):
        if a.mtrain_batches:
            split_id = 0 if split is train else 1
            first = micro * a.batch
            ix = [mtrain_row_start(a.seed, split_id, evaluation, step, r, len(split) - a.seq)
                  for r in range(first, first + a.batch)]
        else:
            ix = torch.randint(len(split) - a.seq, (a.batch,), generator=gen)
        x = torch.stack([split[i:i + a.seq] for i in ix])
        y = torch.stack([split[i + 1:i + 1 + a.seq] for i in ix])
        if cuda:
            return x.pin_memory().to(dev, non_blocking=True), y.pin_memory().to(dev, non_blocking=True)
        return x, y

    def loss_of(x, y):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=cuda and dtype == "bf16"):
            return fwd(x, y)

    @torch.no_grad()
    def estimate_loss(step):
        model.eval()
        out = [sum(loss_of(*get_batch(s, step, i, True)).item() for i in range(a.eval_iters)) / a.eval_iters
               for s in (train, val)]
        model.train()
        return out

    L, C, T = a.layers, a.width, a.seq
    flops_per_token = 6 * (n_params - T * C) + 12 * L * C * T  # nanoGPT's estimate_mfu: wpe not counted
    peak = 989e12 if cuda else 1e11
    tokens_per_step = a.batch * a.seq * a.grad_accum
    os.makedirs(a.out, exist_ok=True)
    metrics = open(os.path.join(a.out, "metrics.jsonl"), "w")
    print(f"torch {torch.__version__}, {a.device} {dtype}, {n_params:,} parameters, vocab {V} (data {data_vocab}), "
          f"train {len(train):,} val {len(val):,} tokens, dropout {a.dropout}", flush=True)
    best, t_run = (math.inf, -1), time.time()
    model.train()
    for step in range(a.steps):
        t0 = time.time()
        lr = lr_at(step, a)
        for g in opt.param_groups:
            g["lr"] = lr
        loss = 0.0
        for micro in range(a.grad_accum):
            l = loss_of(*get_batch(train, step, micro)) / a.grad_accum
            l.backward()
            loss += l.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip if a.clip > 0 else float("inf")).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        dt = time.time() - t0
        last = step + 1 == a.steps
        ev = a.eval_every > 0 and ((step + 1) % a.eval_every == 0 or last)
        tps = tokens_per_step / max(dt, 1e-9)
        m = {"step": step, "run": a.run, "loss": loss, "lr": lr, "grad_norm": norm, "step_ms": dt * 1e3,
             "tokens_per_s": tps, "mfu": flops_per_token * tps / peak,
             "epoch": step * tokens_per_step // len(train)}
        if ev:
            m["train_eval_loss"], m["val_loss"] = estimate_loss(step)
            best = min(best, (m["val_loss"], step + 1))
        if ev or (a.log_every > 0 and (step % a.log_every == 0 or last)):
            metrics.write(json.dumps(m) + "\n")
            metrics.flush()
            line = (f"step {step + 1}/{a.steps} | loss {loss:.4f} | lr {lr:.2e} | norm {norm:.2f} | {dt * 1e3:.1f} ms"
                    f" | {tps:,.0f} tok/s | mfu {100 * m['mfu']:.1f}%")
            if ev:
                line += f" | eval train {m['train_eval_loss']:.4f} | val {m['val_loss']:.4f}"
            print(line, flush=True)
    summary = {"impl": "torch", "run": a.run, "steps": a.steps, "dropout": a.dropout, "best_val": best[0],
               "best_val_step": best[1], "wall_s": time.time() - t_run}
    print(json.dumps(summary), flush=True)
    json.dump(summary, open(os.path.join(a.out, "summary.json"), "w"))


if __name__ == "__main__":
    main()
