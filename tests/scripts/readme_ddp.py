"""The README's DDP example as a whole script, written as users write it: no explicit teardown.

``lockstep run --nproc-per-node 2 tests/scripts/readme_ddp.py`` must exit 0 every time: the
process group is left by lockstep at interpreter exit (see lockstep/teardown.py).
"""

import torch
from torch import nn

import lockstep

info = lockstep.init_distributed()  # torchrun / lockstep run / srun / plain python
torch.manual_seed(0)
net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
model = lockstep.DistributedDataParallel(net.to(info.device))
opt = torch.optim.AdamW(model.parameters())
data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 2))
sampler = lockstep.DistributedSampler(data)
loader = torch.utils.data.DataLoader(data, batch_size=8, sampler=sampler)
for x, y in loader:
    opt.zero_grad()
    nn.functional.mse_loss(model(x.to(info.device)), y.to(info.device)).backward()
    opt.step()
print(f"rank {info.rank} finished")
