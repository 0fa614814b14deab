"""PyTorch's peer for scripts/bench/tensor_parallel/run: the same GPT stack as `train`'s built-in
transformer (pre-LayerNorm blocks, token and position embeddings, a head over the vocabulary),
AdamW, fp32, trained on random tokens; with --tensor 2 its blocks are split by PyTorch's own
tensor parallelism (DTensor: parallelize_module with ColwiseParallel for q, k, v and fc1,
RowwiseParallel for proj and fc2, torchtitan's plan) over Gloo. Started by `launch` (torchrun's
environment); rank 0 writes {"tokens_per_s", "ms_per_step", "parameters"} to --out."""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.proj = nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask):
        b, t, _ = x.shape
        h = self.ln1(x)
        # Local heads: under tensor parallelism q, k and v hold heads / T of them each.
        q, k, v = (m(h) for m in (self.q, self.k, self.v))
        hd = x.shape[-1] // self.heads
        q, k, v = (y.view(b, t, -1, hd).transpose(1, 2) for y in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / hd ** 0.5
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Gpt(nn.Module):
    def __init__(self, vocab, d, layers, heads, context):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, tokens):
        t = tokens.shape[1]
        x = self.tok(tokens) + self.pos(torch.arange(t))
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensor", type=int, default=1)
    ap.add_argument("--d_model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = Gpt(256, a.d_model, a.layers, a.heads, a.context)
    rank = 0
    if a.tensor > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        mesh = init_device_mesh("cpu", (a.tensor,))
        for block in model.blocks:
            block.heads //= a.tensor
            parallelize_module(block, mesh, {"q": ColwiseParallel(), "k": ColwiseParallel(),
                                             "v": ColwiseParallel(), "proj": RowwiseParallel(),
                                             "fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)  # the same batches on every rank of the group
    times = []
    for step in range(a.warmup + a.steps):
        tokens = torch.randint(0, 256, (a.batch, a.context + 1), generator=gen)
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        loss.item()
        if step >= a.warmup:
            times.append(time.perf_counter() - start)
    if rank == 0:
        total = sum(times)
        with open(a.out, "w") as f:
            json.dump({"tokens_per_s": a.batch * a.context * len(times) / total,
                       "ms_per_step": 1000 * total / len(times),
                       "parameters": sum(p.numel() for p in model.parameters())}, f)
    if a.tensor > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
