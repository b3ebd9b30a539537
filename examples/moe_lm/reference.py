#!/usr/bin/env python3
"""The example MoE LM written the way a PyTorch user would write it in Python, for comparison
with the C++ loop (examples/moe_lm): the same model, data, batches, schedule and optimizer
settings, with fp32 parameters under bf16 autocast, experts through torch._grouped_mm, and
torch.optim.AdamW(fused=True). --compile wraps the model in torch.compile.

usage: reference.py [--compile] [the moe_lm flags below] --csv PATH
Prints one line every --log-every steps and writes the same CSV columns as moe_lm (step, loss,
aux_loss, lr, grad_norm, tokens_per_s, ms_per_step, avg_tokens_per_s, avg_ms_per_step,
val_loss, val_ppl, load_min, load_max; the last four are left empty).
"""
import argparse
import math
import os
import time

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02  # as model.cpp


def load_corpus(path, seq):
    """Bytes of a file, or of a directory's files in sorted order (links to one file once)."""
    if os.path.isdir(path):
        seen, files = set(), []
        for name in sorted(os.listdir(path)):
            full = os.path.join(path, name)
            if os.path.isfile(full) and os.path.realpath(full) not in seen:
                seen.add(os.path.realpath(full))
                files.append(full)
    else:
        files = [path]
    data = b"".join(open(f, "rb").read() for f in files)
    valid = len(data) // 10
    all_bytes = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    return all_bytes[: len(data) - valid], all_bytes[len(data) - valid :]


def train_batch(train, args, step, device):
    """The batch of step `step`: the same CPU generator draws as moe_lm's data.cpp."""
    gen = torch.Generator().manual_seed((args.seed * 1000003 + step * 1009) % (1 << 64))
    starts = torch.randint(train.size(0) - args.seq - 1, (args.batch,), generator=gen)
    idx = starts.unsqueeze(1) + torch.arange(args.seq + 1).unsqueeze(0)
    w = train.index_select(0, idx.reshape(-1)).view(args.batch, args.seq + 1)
    return w[:, :-1].to(device), w[:, 1:].to(device)


class RMSNorm(nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight.to(x.dtype), 1e-6)


class MoE(nn.Module):
    """Softmax top-k router (renormalised), Switch aux loss, z-loss, SwiGLU experts without bias,
    probabilities applied after the activation, as torchmoe's MoELayer."""

    def __init__(self, hidden, ffn, experts, topk, aux_coeff, z_coeff):
        super().__init__()
        self.experts, self.topk, self.ffn = experts, topk, ffn
        self.aux_coeff, self.z_coeff = aux_coeff, z_coeff
        self.router = nn.Parameter(torch.empty(experts, hidden))
        self.fc1 = nn.Parameter(torch.empty(experts, 2 * ffn, hidden))
        self.fc2 = nn.Parameter(torch.empty(experts, hidden, ffn))
        for w in (self.router, *self.fc1, *self.fc2):  # kaiming_uniform_(a=√5), as nn.Linear
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))

    def forward(self, x):
        x = x.to(torch.bfloat16)  # the experts' compute dtype (torch._grouped_mm takes bf16)
        tokens, hidden = x.shape
        with torch.autocast("cuda", enabled=False):  # routing in fp32, as the C++ router
            logits = x.float() @ self.router.float().t()
        scores = torch.softmax(logits, -1)
        probs, idx = scores.topk(self.topk, -1)
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        flat = idx.reshape(-1)
        counts = torch.zeros(self.experts, dtype=torch.long, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))
        aux = self.aux_coeff * self.experts / (self.topk * tokens * tokens) * (
            scores.sum(0) * counts.float()).sum()
        z = self.z_coeff * torch.logsumexp(logits, -1).square().mean()
        # Rows grouped by expert (stable), each group padded to a multiple of 8 rows: the grouped
        # wgrad of torch._grouped_mm asserts on other sizes. The buffer has room for the worst
        # case, so its size does not depend on the routing (no host sync).
        order = torch.argsort(flat, stable=True)
        expert_of_row = flat[order]
        padded = (counts + 7) // 8 * 8
        padded_start = torch.cumsum(padded, 0) - padded
        start = torch.cumsum(counts, 0) - counts
        n = flat.numel()
        dest = padded_start[expert_of_row] + torch.arange(n, device=x.device) - start[expert_of_row]
        rows = x.new_zeros(n + 8 * self.experts, hidden).index_copy(0, dest, x[order // self.topk])
        offs = torch.cumsum(padded, 0).to(torch.int32)
        h = torch._grouped_mm(rows, self.fc1.to(x.dtype).transpose(1, 2), offs=offs)
        a, b = h.chunk(2, -1)
        row_probs = x.new_zeros(n + 8 * self.experts, dtype=torch.float32).index_copy(
            0, dest, probs.reshape(-1)[order])
        act = (F.silu(a.float()) * b.float() * row_probs.unsqueeze(1)).to(x.dtype)
        y = torch._grouped_mm(act, self.fc2.to(x.dtype).transpose(1, 2), offs=offs)
        out = torch.zeros(tokens, hidden, dtype=torch.float32, device=x.device).index_add_(
            0, order // self.topk, y.index_select(0, dest).float())
        return out.to(x.dtype), aux + z, counts


class Model(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok = nn.Embedding(256, a.hidden)
        self.pos = nn.Embedding(a.seq, a.hidden)
        nn.init.normal_(self.tok.weight, 0, INIT_STD)
        nn.init.normal_(self.pos.weight, 0, INIT_STD)
        self.heads = a.heads
        self.blocks = nn.ModuleList()
        for _ in range(a.layers):
            block = nn.Module()
            block.norm1, block.norm2 = RMSNorm(a.hidden), RMSNorm(a.hidden)
            block.qkv = nn.Linear(a.hidden, 3 * a.hidden, bias=False)
            block.proj = nn.Linear(a.hidden, a.hidden, bias=False)
            nn.init.normal_(block.qkv.weight, 0, INIT_STD)
            nn.init.normal_(block.proj.weight, 0, INIT_STD)
            block.moe = MoE(a.hidden, a.ffn, a.experts, a.topk, a.aux_coeff, a.z_coeff)
            self.blocks.append(block)
        self.final_norm = RMSNorm(a.hidden)

    def forward(self, tokens):
        b, s = tokens.shape
        x = self.tok(tokens) + self.pos(torch.arange(s, device=tokens.device))
        aux = torch.zeros((), device=tokens.device)
        for block in self.blocks:
            h = block.norm1(x)
            hd = h.shape[-1] // self.heads
            q, k, v = block.qkv(h).view(b, s, 3, self.heads, hd).permute(2, 0, 3, 1, 4)
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + block.proj(att.transpose(1, 2).reshape(b, s, -1))
            y, block_aux, _ = block.moe(block.norm2(x).reshape(b * s, -1))
            x = x + y.view(b, s, -1)
            aux = aux + block_aux
        logits = (self.final_norm(x) @ self.tok.weight.t().to(x.dtype)).float()
        return logits, aux


def learning_rate(a, step):
    if step < a.warmup:
        return a.lr * (step + 1) / a.warmup
    progress = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    low = a.lr * a.min_lr_ratio
    return low + 0.5 * (a.lr - low) * (1 + math.cos(math.pi * progress))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in [("layers", 4), ("hidden", 128), ("heads", 4), ("experts", 8), ("topk", 2),
                          ("ffn", 256), ("seq", 128), ("batch", 16), ("steps", 300), ("warmup", 30),
                          ("seed", 1234), ("log-every", 10)]:
        p.add_argument("--" + name, type=int, default=default)
    for name, default in [("lr", 3e-3), ("min-lr-ratio", 0.1), ("weight-decay", 0.1), ("clip", 1.0),
                          ("aux-coeff", 1e-2), ("z-coeff", 1e-3)]:
        p.add_argument("--" + name, type=float, default=default)
    p.add_argument("--data", default="/usr/share/common-licenses")
    p.add_argument("--csv", default="")
    p.add_argument("--compile", action="store_true")
    a = p.parse_args()
    device = torch.device("cuda")
    torch.manual_seed(a.seed)
    train, _ = load_corpus(a.data, a.seq)
    model = Model(a).to(device)
    decay = [q for q in model.parameters() if q.dim() >= 2]
    no_decay = [q for q in model.parameters() if q.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), fused=True)
    forward = torch.compile(model) if a.compile else model
    params = sum(q.numel() for q in model.parameters())
    print(f"reference.py: {a.layers} layers, hidden {a.hidden}, {a.experts} experts top-{a.topk}, "
          f"ffn {a.ffn}, seq {a.seq} | {params / 1e6:.2f}M parameters | "
          f"{'torch.compile' if a.compile else 'eager'}", flush=True)
    csv = open(a.csv, "w") if a.csv else None
    if csv:
        csv.write("step,loss,aux_loss,lr,grad_norm,tokens_per_s,ms_per_step,avg_tokens_per_s,"
                  "avg_ms_per_step,val_loss,val_ppl,load_min,load_max\n")
    tokens_per_step = a.batch * a.seq
    timed_ms, timed = 0.0, 0
    for step in range(a.steps):
        t0 = time.perf_counter()
        lr = learning_rate(a, step)
        for group in opt.param_groups:
            group["lr"] = lr
        inputs, targets = train_batch(train, a, step, device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits, aux = forward(inputs)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        (loss + aux).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value, aux_value = loss.item(), aux.item()
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1000
        if step > 0:  # the first step includes one-time setup (and compilation)
            timed_ms += ms
            timed += 1
        avg_ms = timed_ms / timed if timed else ms
        if (step + 1) % a.log_every == 0 or step == 0 or step + 1 == a.steps:
            print(f"step {step + 1:>5}/{a.steps} | loss {loss_value:.4f} | aux {aux_value:.4f} | "
                  f"lr {lr:.2e} | {tokens_per_step / avg_ms * 1000:>9.0f} avg tok/s | "
                  f"{avg_ms:>7.1f} avg ms/step", flush=True)
        if csv:
            csv.write(f"{step + 1},{loss_value:.6f},{aux_value:.6f},{lr:.6e},{norm.item():.4f},"
                      f"{tokens_per_step / ms * 1000:.1f},{ms:.2f},"
                      f"{tokens_per_step / avg_ms * 1000:.1f},{avg_ms:.2f},,,,\n")
    if csv:
        csv.close()


if __name__ == "__main__":
    main()
