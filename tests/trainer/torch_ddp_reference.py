r"""PyTorch's own DDP training of a TorchScript model file: the reference that test_torch_parity.py
compares `train` with. Run one process per rank under `launch` (torchrun's environment):

    build/bin/launch --nproc_per_node 2 --python /usr/bin/python3 \
        tests/trainer/torch_ddp_reference.py --model MODEL.pt --data IDX_DIR --out REF.pt \
        [--pass_target] [--find_unused_parameters]

It mirrors the YAML the test gives `train`: IDX data normalised as (x/255 - mean)/std,
DistributedSampler(shuffle=True, seed) with set_epoch, per-rank batches in sampler order with a
last partial batch dropped, SGD with momentum, zero_grad(set_to_none=True). Rank 0 saves
ddp.module.state_dict() (parameters and buffers) with torch.save and prints the step count.

read_idx / load_split / loss_and_logits are imported by the test's comparison script too, so the
data and the output conventions are written down once, here."""

import argparse
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


def loss_and_logits(model, x, y, pass_target):
    """The conventions `train` accepts for a TorchScript forward: logits alone, a tuple whose
    first element is the logits, or a dict with "logits" and optionally the model's own "loss"
    (then forward also takes the target: `inputs: [input, target]`)."""
    out = model(x, y) if pass_target else model(x)
    if isinstance(out, dict):
        logits = out["logits"]
        loss = out["loss"] if "loss" in out else F.cross_entropy(logits, y)
    else:
        logits = out[0] if isinstance(out, (tuple, list)) else out
        loss = F.cross_entropy(logits, y)
    return loss, logits


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
    # parameters() yields a tied Parameter once; frozen ones stay out of the optimizer.
    opt = torch.optim.SGD([q for q in ddp.module.parameters() if q.requires_grad], lr=args.lr,
                          momentum=args.momentum, weight_decay=0.0)
    # Only the order matters here: the sampler over the N indices, nothing else from the data.
    sampler = DistributedSampler(range(len(y)), num_replicas=world, rank=rank, shuffle=True,
                                 seed=args.seed, drop_last=False)
    steps = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        order = list(sampler)
        for start in range(0, len(order) - args.batch_size + 1, args.batch_size):
            idx = torch.tensor(order[start:start + args.batch_size])
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):
                loss, _ = loss_and_logits(ddp, x[idx], y[idx], args.pass_target)
            loss.backward()
            opt.step()
            steps += 1

    if rank == 0:
        torch.save(ddp.module.state_dict(), args.out)
        print(f"steps={steps}", flush=True)
    dist.barrier()  # rank 1 stays until the file is written, so launch's exit means it exists
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
