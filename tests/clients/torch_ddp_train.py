"""A plain torch DDP script, unchanged (torchrun-style). ``SLOW_RANK=R``: rank R sleeps 20 ms per step."""

import os
import time

import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
if dist.get_world_size() > 1:
    m = nn.parallel.DistributedDataParallel(m, bucket_cap_mb=0.05)
opt = torch.optim.SGD(m.parameters(), lr=0.01)
slow = int(os.environ.get("SLOW_RANK", "-1"))
for step in range(30):
    x = torch.randn(32, 64)
    if rank == slow:
        time.sleep(0.02)
    loss = m(x).pow(2).mean()
    loss.backward()
    opt.step(); opt.zero_grad()
dist.destroy_process_group()
