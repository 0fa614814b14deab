r"""PyTorch's own DDP training of a TorchScript model file: the reference that test_torch_parity.py
compares `train` with. Run one process per rank under `launch` (torchrun's environment):

    build/bin/launch --nproc_per_node 2 --python /usr/bin/python3 \
        tests/trainer/torch_ddp_reference.py --model MODEL.pt --data IDX_DIR --out REF.pt \
        [--pass_target] [--find_unused_parameters] [--optimizer adamw --weight_decay W
        --no_decay bias,norm] [--scheduler cosine --warmup_steps K --min_lr_ratio R]
        [--max_grad_norm N] [--label_smoothing S] [--class_weights 1,2,...] [--ignore_index I]

It mirrors the YAML the test gives `train`: IDX data normalised as (x/255 - mean)/std,
DistributedSampler(shuffle=True, seed) with set_epoch, per-rank batches in sampler order with a
last partial batch dropped, SGD with momentum (or AdamW with Hugging Face's parameter groups:
no weight decay for the parameters whose name contains a --no_decay entry, and with `norm`, for
every parameter of a normalisation layer), zero_grad(set_to_none=True), PyTorch's own schedulers
(SequentialLR of LinearLR warm-up and CosineAnnealingLR), clip_grad_norm_ and
F.cross_entropy's options. Rank 0 saves ddp.module.state_dict() (parameters and buffers) with
torch.save and prints the step count, the learning rate of each step (`lrs=[...]`) and how many
steps clip_grad_norm_ clipped (`clipped=N`).

read_idx / load_split / loss_and_logits are imported by the test's comparison script too, so the
data and the output conventions are written down once, here."""

import argparse
import gc
import json
import os
import struct

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data.distributed import DistributedSampler

IDX_MAGIC = {2051: 3, 2049: 1}  # images: N, H, W; labels: N


def read_idx(path):
    """An uncompressed IDX file as a uint8 tensor (big-endian int32 magic and dimensions)."""
    with open(path, "rb") as f:
        data = f.read()
    magic = struct.unpack(">i", data[:4])[0]
    if magic not in IDX_MAGIC:
        raise ValueError(f"{path}: unexpected IDX magic {magic}")
    ndim = IDX_MAGIC[magic]
    dims = struct.unpack(f">{ndim}i", data[4:4 + 4 * ndim])
    # bytearray: torch.frombuffer wants a writable buffer; clone detaches from it.
    pixels = torch.frombuffer(bytearray(data), dtype=torch.uint8, offset=4 + 4 * ndim)
    return pixels.reshape(dims).clone()


def load_split(directory, prefix, mean, std):
    """(inputs float32 [N,1,H,W] normalised as (x/255 - mean)/std, labels int64 [N])."""
    images = read_idx(os.path.join(directory, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(os.path.join(directory, f"{prefix}-labels-idx1-ubyte"))
    x = (images.to(torch.float32).div(255.0).sub(mean)).div(std).unsqueeze(1)
    return x, labels.to(torch.int64)


def loss_and_logits(model, x, y, pass_target, ce=None):
    """The conventions `train` accepts for a TorchScript forward: logits alone, a tuple whose
    first element is the logits, or a dict with "logits" and optionally the model's own "loss"
    (then forward also takes the target: `inputs: [input, target]`). `ce`: keyword arguments of
    F.cross_entropy (label_smoothing, weight, ignore_index)."""
    ce = ce or {}
    out = model(x, y) if pass_target else model(x)
    if isinstance(out, dict):
        logits = out["logits"]
        loss = out["loss"] if "loss" in out else F.cross_entropy(logits, y, **ce)
    else:
        logits = out[0] if isinstance(out, (tuple, list)) else out
        loss = F.cross_entropy(logits, y, **ce)
    return loss, logits


NORM_LAYERS = {"BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LayerNorm", "GroupNorm",
               "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d"}


def parameter_groups(module, weight_decay, no_decay):
    """Hugging Face Trainer's two AdamW groups: decayed, and weight_decay 0 for the parameters
    whose name contains an entry of `no_decay`, plus (entry "norm") every parameter of a
    normalisation layer, found by type (a TorchScript submodule keeps its class name as
    original_name)."""
    in_norm = set()
    if "norm" in no_decay:
        for prefix, sub in module.named_modules():
            kind = getattr(sub, "original_name", type(sub).__name__)
            if kind in NORM_LAYERS:
                in_norm.update((prefix + "." if prefix else "") + n
                               for n, _ in sub.named_parameters(recurse=False))
    decay, plain = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        excluded = name in in_norm or any(entry in name for entry in no_decay)
        (plain if excluded else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}] if decay else []
    if plain:
        groups.append({"params": plain, "weight_decay": 0.0})
    return groups


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="TorchScript file (torch.jit.save)")
    p.add_argument("--data", required=True, help="folder with train-images-idx3-ubyte etc.")
    p.add_argument("--out", required=True, help="where rank 0 writes the trained state_dict")
    p.add_argument("--mean", type=float, default=0.5)
    p.add_argument("--std", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--pass_target", action="store_true", help="forward(x, target)")
    p.add_argument("--find_unused_parameters", action="store_true")
    p.add_argument("--bf16", action="store_true",
                   help='forward and loss under torch.autocast("cpu", torch.bfloat16)')
    p.add_argument("--fp16", action="store_true",
                   help='torch.autocast("cpu", torch.float16) with torch.amp.GradScaler, the '
                        "schedule stepped only when the optimizer was (accelerate's rule)")
    p.add_argument("--comm_hook", choices=["none", "fp16", "power_sgd"], default="none",
                   help="fp16: default_hooks.fp16_compress_hook (accelerate's comm_hook FP16); "
                        "power_sgd: powerSGD_hook with PowerSGDState(None, **--power_sgd)")
    p.add_argument("--power_sgd", default="{}", help="PowerSGDState's options, as JSON")
    p.add_argument("--init_scale", type=float, default=65536.0)
    p.add_argument("--growth_interval", type=int, default=2000)
    p.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--no_decay", default="", help="adamw: comma-separated, e.g. bias,norm")
    p.add_argument("--scheduler", choices=["constant", "cosine"], default="constant")
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--min_lr_ratio", type=float, default=0.0)
    p.add_argument("--max_grad_norm", type=float, default=0.0)
    p.add_argument("--label_smoothing", type=float, default=0.0)
    p.add_argument("--class_weights", default="", help="comma-separated, one per class")
    p.add_argument("--ignore_index", type=int, default=-100)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env:// from launch
    rank, world = dist.get_rank(), dist.get_world_size()

    x, y = load_split(args.data, "train", args.mean, args.std)
    # As `train` does: no TorchScript graph fusion on CPU. PyTorch 2.6's LLVM compile of fused
    # kernels never returned for some of these models (this reference hung at its third step).
    torch._C._jit_set_texpr_fuser_enabled(False)
    model = torch.jit.load(args.model)
    model.train()  # the file may have been saved in eval mode
    ddp = DistributedDataParallel(model, broadcast_buffers=True,
                                  find_unused_parameters=args.find_unused_parameters)
    if args.comm_hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.comm_hook == "power_sgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
        state = powersgd.PowerSGDState(None, **json.loads(args.power_sgd))
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    if args.optimizer == "adamw":
        no_decay = [entry for entry in args.no_decay.split(",") if entry]
        opt = torch.optim.AdamW(parameter_groups(ddp.module, args.weight_decay, no_decay),
                                lr=args.lr, weight_decay=args.weight_decay)
    else:
        # parameters() yields a tied Parameter once; frozen ones stay out of the optimizer.
        opt = torch.optim.SGD([q for q in ddp.module.parameters() if q.requires_grad],
                              lr=args.lr, momentum=args.momentum, weight_decay=0.0)
    ce = {"label_smoothing": args.label_smoothing, "ignore_index": args.ignore_index}
    if args.class_weights:
        ce["weight"] = torch.tensor([float(w) for w in args.class_weights.split(",")])
    # Only the order matters here: the sampler over the N indices, nothing else from the data.
    sampler = DistributedSampler(range(len(y)), num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=False)
    per_epoch = len(sampler) // args.batch_size
    schedule = None
    if args.scheduler == "cosine":
        # Linear warm-up to lr over warmup_steps (the first step at lr / warmup_steps), then a
        # cosine to min_lr_ratio * lr at the last step.
        lr_sched = torch.optim.lr_scheduler
        total = args.epochs * per_epoch
        schedule = lr_sched.SequentialLR(opt, [
            lr_sched.LinearLR(opt, start_factor=1.0 / args.warmup_steps, end_factor=1.0,
                              total_iters=args.warmup_steps - 1),
            lr_sched.CosineAnnealingLR(opt, T_max=total - args.warmup_steps,
                                       eta_min=args.lr * args.min_lr_ratio)],
            milestones=[args.warmup_steps])
    scaler = (torch.amp.GradScaler("cpu", init_scale=args.init_scale,
                                   growth_interval=args.growth_interval) if args.fp16 else None)
    dtype = torch.float16 if args.fp16 else torch.bfloat16
    steps, clipped, skipped, lrs = 0, 0, 0, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, len(order) - args.batch_size + 1, args.batch_size):
            idx = torch.tensor(order[start:start + args.batch_size])
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=dtype, enabled=args.bf16 or args.fp16):
                loss, _ = loss_and_logits(ddp, x[idx], y[idx], args.pass_target, ce)
            (scaler.scale(loss) if scaler else loss).backward()
            if args.max_grad_norm > 0:
                if scaler:
                    scaler.unscale_(opt)
                norm = torch.nn.utils.clip_grad_norm_(ddp.module.parameters(), args.max_grad_norm)
                clipped += int(norm > args.max_grad_norm)
            lrs.append(opt.param_groups[0]["lr"])
            stepped = True
            if scaler:
                before = scaler.get_scale()
                scaler.step(opt)
                scaler.update()
                stepped = scaler.get_scale() >= before  # a backoff: the step was skipped
                skipped += int(not stepped)
            else:
                opt.step()
            if schedule and stepped:
                schedule.step()
            steps += 1

    if rank == 0:
        torch.save(ddp.module.state_dict(), args.out)
        print(f"steps={steps}", flush=True)
        print(f"lrs={json.dumps(lrs)}", flush=True)
        print(f"clipped={clipped}", flush=True)
        print(f"skipped={skipped}", flush=True)
    dist.barrier()  # rank 1 stays until the file is written, so launch's exit means it exists
    # DDP's reducer holds the group, and DDP's reference cycles would otherwise keep it until
    # the interpreter's finalisation, where destroying Gloo's work (tensors with Python
    # references) from its threads aborts the process now and then ("terminate called without
    # an active exception", seen on PyTorch 1.13 after every result was written). Freed here,
    # while the interpreter is whole.
    del ddp, opt, schedule, scaler
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
