"""A torch DDP script that refuses to run on fewer than 2 workers (as Lightning's devices=2 does).

Used by tests/test_doctor_baseline.py: ``lockstep doctor`` explains its 2-worker run without the
1-worker baseline.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

if int(os.environ.get("WORLD_SIZE", "1")) < 2:
    sys.exit("doctor_needs_two_workers.py: this script needs 2 workers, got "
             f"{os.environ.get('WORLD_SIZE', '1')}")
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(),
                                                          nn.Linear(32, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for _ in range(200):
    loss = model(torch.randn(8, 16)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
