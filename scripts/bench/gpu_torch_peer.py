#!/usr/bin/python3
"""PyTorch's side of scripts/bench/gpu: one process doing what `train` does in each row, with the
data on the device, the same batch, model, optimizer and schedule, loss.item() every step (as
`train` and any logging loop do), the timed region bounded by torch.cuda.synchronize().

  --workload cnn          configs/quickstart.yaml's CNN on Fashion-MNIST (the model, sampler
                          order, AdamW groups and warm-up + cosine of fashion_mnist_torch.py),
                          the whole loop timed, then test accuracy on the 10,000 t10k images
  --workload mlp          MLP --layers, Adam, synthetic N(0,1) inputs and random labels;
                          --warmup steps untimed, then --steps timed
  --workload transformer  `train`'s built-in causal transformer (pre-LayerNorm GPT blocks with
                          the same explicit attention), AdamW, byte windows of --text; as mlp

--bf16: forward and loss under torch.autocast(device, torch.bfloat16); --fp16: under
torch.autocast(device, torch.float16) with torch.amp.GradScaler (as accelerate's fp16). --ddp: the
model in
DistributedDataParallel at world 1 (NCCL on CUDA, Gloo on the CPU; the environment must name
MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE); otherwise a plain loop, which is what `train` runs at
world 1 (its strategy `none`). Writes {"loop_s", "steps", "samples", "tokens", ...} to --out."""

import argparse
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fashion_mnist_torch as fm  # noqa: E402  (the CNN, its optimizer groups and schedule)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Block(nn.Module):
    """trainer_runtime/model/layers.h's BlockImpl: the same parameters and maths."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask):
        b, t, c = x.shape
        hd = c // self.heads
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, hd)
        q, k, v = (qkv.select(2, i).transpose(1, 2) for i in range(3))
        att = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(hd)
        att = torch.softmax(att.masked_fill(mask, float("-inf")), -1)
        y = torch.matmul(att, v).transpose(1, 2).contiguous().view(b, t, c)
        h = x + self.proj(y)
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class Transformer(nn.Module):
    """trainer_runtime/model/model.cc's TransformerImpl (dropout 0)."""

    def __init__(self, vocab, d, layers, heads, context):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, tokens):
        t = tokens.size(1)
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        mask = torch.ones(t, t, dtype=torch.bool, device=tokens.device).triu(1)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def mlp(widths):
    """`train`'s model mlp: Linear layers with ReLU between them."""
    layers = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def text_windows(path, context, device):
    """`train`'s data type text: windows of context+1 bytes with stride context."""
    with open(path, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    n = (len(data) - 1) // context
    idx = (torch.arange(n) * context).unsqueeze(1) + torch.arange(context).unsqueeze(0)
    return data[idx].to(device), data[idx + 1].to(device)


def autocast(a, device):
    """The autocast scope --bf16 or --fp16 asks for (disabled without either)."""
    return torch.autocast(device.type, dtype=torch.float16 if a.fp16 else torch.bfloat16,
                          enabled=a.bf16 or a.fp16)


class Scaler:
    """--fp16's GradScaler around backward and step; plain backward and step otherwise."""

    def __init__(self, a, device):
        self.scaler = torch.amp.GradScaler(device.type) if a.fp16 else None

    def backward_and_step(self, loss, opt):
        if self.scaler is None:
            loss.backward()
            opt.step()
            return
        self.scaler.scale(loss).backward()
        self.scaler.step(opt)
        self.scaler.update()


def timed_steps(a, device, model, opt, x, y, loss_fn):
    """--warmup untimed steps, then --steps timed ones over random batches of (x, y)."""
    n = x.size(0)
    order, at = torch.randperm(n, device=device), 0
    scaler = Scaler(a, device)

    def step():
        nonlocal order, at
        if at + a.batch > n:
            order, at = torch.randperm(n, device=device), 0
        idx = order[at:at + a.batch]
        at += a.batch
        with autocast(a, device):
            loss = loss_fn(model(x[idx]), y[idx])
        opt.zero_grad()
        scaler.backward_and_step(loss, opt)
        return loss.item()

    for _ in range(a.warmup):
        step()
    sync(device)
    start = time.perf_counter()
    for _ in range(a.steps):
        last = step()
    sync(device)
    return {"loop_s": time.perf_counter() - start, "steps": a.steps, "loss": last}


def run_cnn(a, device, wrap):
    train_x, train_y = fm.load_split(a.data, "train")
    test_x, test_y = fm.load_split(a.data, "t10k")
    train_x, train_y = train_x.to(device), train_y.to(device)
    torch.manual_seed(42)
    model = fm.Cnn([16, 32], 128, 0.25).to(device)
    net = wrap(model)
    opt = torch.optim.AdamW(fm.param_groups(model, 0.01), lr=3e-3, betas=(0.9, 0.999), eps=1e-8)
    sampler = torch.utils.data.distributed.DistributedSampler(
        range(len(train_y)), num_replicas=1, rank=0, shuffle=True, seed=42, drop_last=False)
    per_epoch = len(sampler) // a.batch
    total = a.max_steps if a.max_steps > 0 else a.epochs * per_epoch
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: fm.lr_factor(s, 100, total))
    model.train()
    scaler = Scaler(a, device)
    step, epoch, last = 0, 0, float("nan")
    sync(device)
    start = time.perf_counter()
    while step < total:
        sampler.set_epoch(epoch)
        order = torch.tensor(list(sampler), device=device)
        for b in range(per_epoch):
            if step >= total:
                break
            idx = order[b * a.batch:(b + 1) * a.batch]
            with autocast(a, device):
                loss = F.cross_entropy(net(train_x[idx]), train_y[idx])
            opt.zero_grad()
            scaler.backward_and_step(loss, opt)
            sched.step()
            last = loss.item()
            step += 1
        epoch += 1
    sync(device)
    loop_s = time.perf_counter() - start
    model.eval()
    correct = 0
    with torch.no_grad():
        for chunk in range(0, len(test_y), 1000):
            xs = test_x[chunk:chunk + 1000].to(device)
            with autocast(a, device):
                logits = model(xs).float()
            correct += (logits.argmax(1).cpu() == test_y[chunk:chunk + 1000]).sum().item()
    return {"loop_s": loop_s, "steps": step, "samples": step * a.batch, "loss": last,
            "test_accuracy": correct / len(test_y)}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", required=True, choices=["cnn", "mlp", "transformer"])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--fp16", action="store_true")
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=10, help="mlp, transformer: untimed steps")
    ap.add_argument("--steps", type=int, default=100, help="mlp, transformer: timed steps")
    ap.add_argument("--epochs", type=int, default=3, help="cnn")
    ap.add_argument("--max_steps", type=int, default=0, help="cnn: > 0 stops after these steps")
    ap.add_argument("--data", default="/usr/share/datasets/fashion-mnist", help="cnn")
    ap.add_argument("--layers", default="784,4096,4096,4096,10", help="mlp widths")
    ap.add_argument("--samples", type=int, default=16384, help="mlp: synthetic rows")
    ap.add_argument("--text", help="transformer: the text file")
    ap.add_argument("--d_model", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    if a.device == "cpu":
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) \
        if a.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    wrap = lambda m: m  # noqa: E731
    if a.ddp:
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        ids = [device.index] if device.type == "cuda" else None
        wrap = lambda m: DDP(m, device_ids=ids)  # noqa: E731

    if a.workload == "cnn":
        result = run_cnn(a, device, wrap)
    elif a.workload == "mlp":
        torch.manual_seed(42)
        widths = [int(w) for w in a.layers.split(",")]
        model = mlp(widths).to(device)
        x = torch.randn(a.samples, widths[0], device=device)
        y = torch.randint(0, widths[-1], (a.samples,), device=device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        result = timed_steps(a, device, wrap(model), opt, x, y, F.cross_entropy)
        result["samples"] = a.steps * a.batch
    else:
        torch.manual_seed(42)
        model = Transformer(256, a.d_model, a.blocks, a.heads, a.context).to(device)
        x, y = text_windows(a.text, a.context, device)
        # `train`'s no_decay default: biases and normalisation weights.
        decay = [p for n, p in model.named_parameters() if "bias" not in n and "ln" not in n]
        rest = [p for n, p in model.named_parameters() if "bias" in n or "ln" in n]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                 {"params": rest, "weight_decay": 0.0}], lr=1e-3)
        result = timed_steps(a, device, wrap(model), opt, x, y,
                             lambda logits, t: F.cross_entropy(logits.flatten(0, 1), t.flatten()))
        result["tokens"] = a.steps * a.batch * a.context
    result.update(torch=torch.__version__, device=str(device), ddp=a.ddp, bf16=a.bf16,
                  fp16=a.fp16)
    with open(a.out, "w") as f:
        json.dump(result, f)
    if a.ddp:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
