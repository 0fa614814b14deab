#!/usr/bin/python3
"""PyTorch's own DDP (Debian python3-torch, Gloo) doing what `train` does with the Fashion-MNIST
config of scripts/bench/fashion_mnist: the same CNN (conv-bn-relu-maxpool blocks, fc, dropout,
head), the same data order (DistributedSampler, seed 42, batch 64 per rank, last partial batch
dropped), AdamW with the Hugging Face no-decay groups, linear warmup then cosine per optimizer
step, loss.item() every step (as any logging loop does), fp32, one thread per rank.

At the end rank 0's model, in eval mode, is scored on all 10,000 t10k images: every rank scores a
strided share and the sums are all-reduced. Rank 0 writes {"loop_s", "samples", "test_accuracy",
"test_loss", "epochs", "wall_s", ...} to --out."""

import argparse
import gzip
import json
import math
import os
import struct
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data.distributed import DistributedSampler

# Fashion-MNIST's training-set pixel mean and standard deviation (of x/255).
MEAN, STD = 0.2860, 0.3530


def read_idx(path, magic):
    """One gzipped IDX file as a uint8 tensor shaped by its header's dimensions."""
    with gzip.open(path, "rb") as f:
        data = f.read()
    ndim = {2049: 1, 2051: 3}[magic]
    header = struct.unpack(f">{1 + ndim}i", data[:4 * (1 + ndim)])
    if header[0] != magic:
        raise SystemExit(f"{path}: magic {header[0]}, expected {magic}")
    dims = header[1:]
    # bytearray: torch.frombuffer warns about (and must not write to) read-only bytes.
    body = bytearray(data[4 * (1 + ndim):])
    if len(body) != math.prod(dims):
        raise SystemExit(f"{path}: {len(body)} bytes of data, header says {dims}")
    return torch.frombuffer(body, dtype=torch.uint8).reshape(dims)


def load_split(data_dir, prefix):
    """Normalized images [N,1,28,28] float32 and int64 labels of one split ("train", "t10k")."""
    images = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"), 2051)
    labels = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"), 2049)
    x = ((images.float() / 255.0 - MEAN) / STD).unsqueeze(1).contiguous()
    return x, labels.long()


class Cnn(nn.Module):
    """conv{i} (3x3, no bias: bn{i} follows) -> bn{i} -> relu -> 2x2 max-pool for each channel
    count, then fc -> relu -> dropout -> head. Parameter names match `train`'s cnn model."""

    def __init__(self, channels, hidden, dropout, classes=10, side=28):
        super().__init__()
        self.blocks = len(channels)
        c_in = 1
        for i, c in enumerate(channels, start=1):
            setattr(self, f"conv{i}", nn.Conv2d(c_in, c, 3, padding=1, bias=False))
            setattr(self, f"bn{i}", nn.BatchNorm2d(c))
            c_in = c
            side //= 2
        self.dropout = dropout
        self.fc = nn.Linear(c_in * side * side, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        for i in range(1, self.blocks + 1):
            x = getattr(self, f"conv{i}")(x)
            x = F.max_pool2d(F.relu(getattr(self, f"bn{i}")(x)), 2)
        x = F.relu(self.fc(x.flatten(1)))
        x = F.dropout(x, p=self.dropout, training=self.training)
        return self.head(x)


def param_groups(model, weight_decay):
    """Hugging Face Trainer's rule: no weight decay on biases and normalization parameters."""
    norm_params = {id(p) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                   for p in m.parameters(recurse=False)}
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if name.endswith("bias") or id(p) in norm_params:
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def lr_factor(step, warmup, total):
    """The multiplier of the base learning rate at optimizer step `step` (0-based): linear
    warmup, then half a cosine down to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(max((step - warmup) / max(1, total - warmup), 0.0), 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def main():
    wall_start = time.perf_counter()
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="per rank")
    ap.add_argument("--channels", default="16,32", help="output channels of the conv blocks")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--dropout", type=float, default=0.25)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight_decay", type=float, default=0.01)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--bucket_cap_mb", type=float, default=25)
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--out", required=True)
    ap.add_argument("--bf16", action="store_true",
                    help='forward and loss under torch.autocast("cpu", torch.bfloat16)')
    a = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    train_x, train_y = load_split(a.data, "train")
    test_x, test_y = load_split(a.data, "t10k")
    torch.manual_seed(a.seed)  # every rank builds the same model (DDP broadcasts rank 0's anyway)
    model = Cnn([int(c) for c in a.channels.split(",")], a.hidden, a.dropout)
    ddp = DDP(model, bucket_cap_mb=a.bucket_cap_mb)  # broadcast_buffers=True: BN stats of rank 0
    opt = torch.optim.AdamW(param_groups(model, a.weight_decay), lr=a.lr, betas=(0.9, 0.999),
                            eps=1e-8)
    # The sampler only needs the dataset's length; its epoch order is what DataLoader would use.
    sampler = DistributedSampler(range(len(train_y)), num_replicas=world, rank=rank, shuffle=True,
                                 seed=a.seed, drop_last=False)
    steps_per_epoch = len(sampler) // a.batch  # DataLoader(drop_last=True)
    total = a.epochs * steps_per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, a.warmup, total))

    model.train()
    step = 0
    loop_start = time.perf_counter()
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler))
        # Indexing the in-memory tensors by the sampler's order, 64 at a time, is what
        # DataLoader(batch_size=64, drop_last=True, num_workers=0) yields, without its overhead.
        for b in range(steps_per_epoch):
            idx = order[b * a.batch:(b + 1) * a.batch]
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
                loss = F.cross_entropy(ddp(train_x[idx]), train_y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            loss.item()
            step += 1
    loop_s = time.perf_counter() - loop_start

    # Broadcast buffers ran before each forward, so each rank's BN running stats now hold rank
    # 0's plus its own last batch: give every rank rank 0's, so the strided shares below score
    # one model (the same numbers as rank 0 scoring all 10,000 alone).
    for buf in model.buffers():
        dist.broadcast(buf, 0)
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # correct, summed loss, count
    with torch.no_grad():
        share = torch.arange(rank, len(test_y), world)
        for chunk in share.split(1000):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.bf16):
                logits = model(test_x[chunk]).float()
            sums[0] += (logits.argmax(1) == test_y[chunk]).sum().item()
            sums[1] += F.cross_entropy(logits, test_y[chunk], reduction="sum").item()
            sums[2] += len(chunk)
    dist.all_reduce(sums)
    if rank == 0:
        result = {"loop_s": loop_s, "samples": step * a.batch * world, "steps": step,
                  "steps_per_epoch": steps_per_epoch, "world_size": world,
                  "test_accuracy": sums[0].item() / sums[2].item(),
                  "test_loss": sums[1].item() / sums[2].item(), "test_samples": int(sums[2]),
                  "epochs": a.epochs, "wall_s": time.perf_counter() - wall_start}
        with open(a.out, "w") as f:
            json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main()
