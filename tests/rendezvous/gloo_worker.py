"""A Python worker for the stock-hosts test: one torch.distributed Gloo all-reduce of RANK + 1
across every rank (env:// from the agent's MASTER_ADDR/MASTER_PORT), then a line with the sum
and the interfaces the agent gave it."""
import datetime
import os

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()}: SUM {t.item():g} ifname "
      f"gloo={os.environ.get('GLOO_SOCKET_IFNAME', '')} "
      f"nccl={os.environ.get('NCCL_SOCKET_IFNAME', '')}", flush=True)
dist.destroy_process_group()
