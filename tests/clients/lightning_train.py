"""A Lightning Trainer script (DDP strategy on CPU), unchanged: a tiny random MLP (no downloads).

``SLOW_RANK=R`` makes rank R sleep 30 ms before each batch (a callback), for the doctor to name.
"""

import os
import time

import lightning as L
import torch
from torch import nn


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Slow(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_rank == int(os.environ.get("SLOW_RANK", "-1")):
            time.sleep(0.03)


def main() -> None:
    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 64), torch.randn(4096, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy="ddp", max_steps=60,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Slow()])
    trainer.fit(Model(), loader)


if __name__ == "__main__":
    main()
