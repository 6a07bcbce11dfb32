"""A Hugging Face Trainer script, unchanged: a tiny random GPT-2 on random tokens (no downloads).

``SLOW_RANK=R`` makes rank R sleep 30 ms before each step (a callback), for the doctor to name.
"""

import os
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, 128, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Slow(TrainerCallback):
    def on_step_begin(self, args, state, control, **kwargs):
        if int(os.environ.get("RANK", "0")) == int(os.environ.get("SLOW_RANK", "-1")):
            time.sleep(0.03)


def main() -> None:
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2,
                                       n_head=2))
    args = TrainingArguments(output_dir=os.environ.get("TMPDIR", "/tmp") + "/hf_out",
                             use_cpu=True, per_device_train_batch_size=8, max_steps=60,
                             report_to=[], save_strategy="no", logging_strategy="no",
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[Slow()]).train()


if __name__ == "__main__":
    main()
