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

    def test_tcpstore_server_is_the_classic_one_unless_the_user_chose(self):
        # PyTorch 2.x's env:// store wants libuv unless USE_LIBUV=0 (Debian 13's PyTorch has none:
        # the DDP script above fails there without it); a user's own USE_LIBUV is passed as is.
        d = tmpdir()
        path = os.path.join(d, "show.py")
        with open(path, "w") as f:
            f.write("import os\nprint('USE_LIBUV=' + os.environ.get('USE_LIBUV', '<unset>'))\n")
        r = launch("--nproc_per_node", "2", "--python", SYSTEM_PYTHON, path,
                   env={"USE_LIBUV": None})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.count("USE_LIBUV=0"), 2, r.stdout)
        r = launch("--nproc_per_node", "2", "--python", SYSTEM_PYTHON, path,
                   env={"USE_LIBUV": "1"})
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertEqual(r.stdout.count("USE_LIBUV=1"), 2, r.stdout)


if __name__ == "__main__":
    unittest.main()
