#!/usr/bin/python3
"""PyTorch's side of scripts/bench/zero/run: the same MLP, Adam, fp32 and synthetic data as the
`train` rows, under DDP (Gloo), optionally with torch.distributed.optim.ZeroRedundancyOptimizer
(ZeRO stage 1: each rank keeps and steps the Adam state of its share of the parameters, then
broadcasts them). loss.item() every step, as any logging loop does (and as `train` does).

Rank 0 writes {"step_ms": [...], "world_size": N, "params": P} to --out; peak RSS is sampled
from outside by the harness (the same way for every row)."""

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="784,4096,4096,4096,10")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--zero", action="store_true", help="ZeroRedundancyOptimizer around Adam")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    widths = [int(w) for w in a.layers.split(",")]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(torch.nn.ReLU())
    model = DDP(torch.nn.Sequential(*layers))
    if a.zero:
        from torch.distributed.optim import ZeroRedundancyOptimizer
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam,
                                      lr=a.lr)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=a.lr)
    n = 4096
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(n, widths[0], generator=g)
    y = torch.randint(0, widths[-1], (n,), generator=g)
    step_ms = []
    for _ in range(a.steps):
        start = time.perf_counter()
        idx = torch.randint(0, n, (a.batch,), generator=g)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        opt.step()
        loss.item()
        step_ms.append((time.perf_counter() - start) * 1000)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump({"step_ms": step_ms, "world_size": dist.get_world_size(),
                       "params": sum(p.numel() for p in model.parameters())}, f)
    dist.barrier()


if __name__ == "__main__":
    main()
