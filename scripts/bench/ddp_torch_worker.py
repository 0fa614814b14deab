#!/usr/bin/python3
"""PyTorch's own DDP (Debian python3-torch, Gloo) doing what `train` does in the benchmarks:
MLP 784-H-H-10, SGD, synthetic data, loss.item() every step (as any logging loop does).
Rank 0 writes {"loop_s": ..., "steps": ..., "global_batch": ...} to --out.

--accum K: K micro-batches per optimizer step (gradient accumulation), each synchronised, or
with --no_sync all but the last under DDP's no_sync() (as accelerate's accumulate()).

Also --mode allreduce: time all-reducing NUMEL floats split into buckets of CAP_MB (the
communication-only baseline of the overlap benchmark).

--layers 256,1536,1536,10 --optimizer adamw --comm_hook power_sgd --power_sgd '{...}': another MLP,
AdamW, and a DDP communication hook (fp16_compress_hook, or powerSGD_hook with those
PowerSGDState options): the multihost benchmark's PyTorch rows."""

import argparse
import contextlib
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="train", choices=["train", "allreduce"])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--bucket_cap_mb", type=float, default=25)
    ap.add_argument("--numel", type=int, default=0)
    ap.add_argument("--sizes", default="", help="bucket sizes in floats, comma-separated")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--no_sync", action="store_true")
    ap.add_argument("--layers", default="", help="the MLP's widths (default 784,H,H,10)")
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"])
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--comm_hook", default="none", choices=["none", "fp16", "power_sgd"])
    ap.add_argument("--power_sgd", default="{}", help="PowerSGDState's options, as JSON")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    if a.mode == "allreduce":
        if a.sizes:
            sizes = [int(v) for v in a.sizes.split(",")]
        else:
            cap = int(a.bucket_cap_mb * (1 << 20) / 4)
            sizes = []
            left = a.numel
            while left > 0:
                sizes.append(min(cap, left))
                left -= sizes[-1]
        bufs = [torch.randn(n) for n in sizes]
        for b in bufs:
            dist.all_reduce(b)
        start = time.perf_counter()
        for _ in range(a.steps):
            works = [dist.all_reduce(b, async_op=True) for b in bufs]
            for w in works:
                w.wait()
        elapsed = time.perf_counter() - start
        if rank == 0:
            json.dump({"ms_per_step": elapsed / a.steps * 1000, "buckets": len(sizes)},
                      open(a.out, "w"))
        dist.barrier()
        return
    h = a.hidden
    widths = [int(w) for w in a.layers.split(",")] if a.layers else [784, h, h, 10]
    layers = []
    for i in range(len(widths) - 1):
        layers.append(torch.nn.Linear(widths[i], widths[i + 1]))
        if i + 2 < len(widths):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)
    ddp = DDP(model, bucket_cap_mb=a.bucket_cap_mb)
    if a.comm_hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif a.comm_hook == "power_sgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
        state = powersgd.PowerSGDState(None, **json.loads(a.power_sgd))
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    if a.optimizer == "adamw":
        opt = torch.optim.AdamW(ddp.parameters(), lr=a.lr)
    else:
        opt = torch.optim.SGD(ddp.parameters(), lr=a.lr)
    n = 8192
    x = torch.randn(n, widths[0])
    y = torch.randint(0, widths[-1], (n,))
    g = torch.Generator().manual_seed(rank)
    start = time.perf_counter()
    for step in range(a.steps):
        opt.zero_grad()
        for micro in range(a.accum):
            idx = torch.randint(0, n, (a.batch,), generator=g)
            last = micro == a.accum - 1
            with ddp.no_sync() if a.no_sync and not last else contextlib.nullcontext():
                loss = torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx]) / a.accum
                loss.backward()
            loss.item()
        opt.step()
    elapsed = time.perf_counter() - start
    if rank == 0:
        json.dump({"loop_s": elapsed, "steps": a.steps,
                   "global_batch": a.batch * dist.get_world_size()}, open(a.out, "w"))
    dist.barrier()


if __name__ == "__main__":
    main()
