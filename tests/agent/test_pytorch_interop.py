"""`launch` runs an unchanged PyTorch DDP script (Debian's python3-torch, Gloo, env://)."""

import os
import re
import unittest

from harness import SYSTEM_PYTHON, launch, tmpdir

SCRIPT = r'''
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
rank, world = dist.get_rank(), dist.get_world_size()
assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
torch.manual_seed(rank)
loss = model(torch.randn(8, 4)).pow(2).mean()
loss.backward()
g = model.module.weight.grad.clone()
gathered = [torch.zeros_like(g) for _ in range(world)]
dist.all_gather(gathered, g)
same = all(torch.allclose(gathered[0], x) for x in gathered)
print(f"allreduce={t.item():.1f} world={world} grads_equal={same}")
dist.destroy_process_group()
'''


class PyTorchInterop(unittest.TestCase):
    def test_ddp_script_under_launch(self):
        d = tmpdir()
        path = os.path.join(d, "ddp_check.py")
        with open(path, "w") as f:
            f.write(SCRIPT)
        r = launch("--nproc_per_node", "2", "--python", SYSTEM_PYTHON, path, timeout=240)
        self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
        for rank in (0, 1):
            self.assertIn(f"[rank {rank}]: allreduce=3.0 world=2 grads_equal=True", r.stdout)


if __name__ == "__main__":
    unittest.main()
