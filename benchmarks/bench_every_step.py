"""What a checkpoint every step costs a training loop, measured in interleaved blocks.

    OMP_NUM_THREADS=1 python -m lockstep run --nproc-per-node 2 benchmarks/bench_every_step.py
    OMP_NUM_THREADS=1 python benchmarks/bench_every_step.py        # one process
    python benchmarks/bench_every_step.py --device cuda             # one process on a GPU

Trains the demo's model (``examples/chargpt.py``: a 0.8M-parameter GPT with AdamW, ~10 MB of
state) with lockstep's DDP on random tokens, in blocks of ``--block`` steps that take turns:

- ``bare``: no checkpoint;
- ``lockstep``: ``Checkpointer.save()`` after every step, asynchronous with
  ``when_busy="skip"``, as ``examples/train_gpt.py --checkpoint-every 1`` does (a save that
  finds the previous one still being written is skipped);
- ``lockstep 5%``: the same calls to a ``Checkpointer(max_overhead=0.05)``, which saves only as
  often as 5% of the loop's time allows (the other calls are skipped; the table counts the
  steps that were saved);
- ``torch.save``: rank 0 saves the model's and optimizer's ``state_dict()`` after every step
  with ``torch.save`` (no fsync), what a hand-written loop does.

Blocks next to each other share the machine's conditions, so the ratio of their step times is
steadier than separate runs on a shared machine; the median over rounds sets aside a round that
a burst of other work hit. The first round is warm-up, not counted; the steps right after a
block of saves (whose last write may still run) count toward the next block, as training would
feel them. Rank 0 prints each mode's step time and its throughput against ``bare`` (bare's
step time over the mode's, in the same round).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import lockstep

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from chargpt import GPT, GPTConfig

MODES = ("bare", "lockstep", "lockstep 5%", "torch.save")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block", type=int, default=10, help="steps per block")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of one block per mode, after one of warm-up")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step on each rank")
    parser.add_argument("--device", default=None,
                        help="cpu or cuda (default: lockstep's choice, a GPU per rank when there are GPUs)")
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint directory (default: a temporary one)")
    args = parser.parse_args()
    info = lockstep.init_distributed(device=args.device)
    rank, device = info.rank, info.device
    torch.manual_seed(0)
    config = GPTConfig(97, 128, 4, 4, 128)  # the demo's defaults
    model = lockstep.DistributedDataParallel(GPT(config).to(device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    generator = torch.Generator().manual_seed(rank)
    with tempfile.TemporaryDirectory() as scratch:
        shared = [str(args.dir if args.dir is not None else scratch)]
        if info.world_size > 1:  # every rank saves into rank 0's directory
            dist.broadcast_object_list(shared, src=0)
        root = Path(shared[0])
        ckpt = lockstep.Checkpointer(root / "lockstep", keep=2, when_busy="skip")
        paced = lockstep.Checkpointer(root / "paced", keep=2, max_overhead=0.05)
        saved: dict[str, int] = dict.fromkeys(MODES, 0)  # steps saved in the counted rounds
        plain = root / f"torch-rank{rank}.pt"
        blocks: dict[str, list[float]] = {mode: [] for mode in MODES}  # mean step time per block
        step = 0
        for round_ in range(args.rounds + 1):
            for mode in MODES:
                began = time.perf_counter()
                for _ in range(args.block):
                    tokens = torch.randint(0, config.vocab_size, (args.batch_size, config.block_size + 1),
                                           generator=generator).to(device, non_blocking=True)
                    logits = model(tokens[:, :-1])
                    loss = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:])
                    optimizer.zero_grad(set_to_none=True)
                    loss.backward()
                    optimizer.step()
                    step += 1
                    if mode in ("lockstep", "lockstep 5%"):
                        chosen = ckpt if mode == "lockstep" else paced
                        chosen.save(step, model=model, optimizer=optimizer)
                        saved[mode] += round_ > 0 and not chosen.last_skipped
                    elif mode == "torch.save":
                        saved[mode] += round_ > 0
                    if mode == "torch.save" and rank == 0:
                        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, plain)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the block's own device work, not the next's
                if round_ > 0:
                    blocks[mode].append((time.perf_counter() - began) / args.block)
        ckpt.close()
        paced.close()
        if info.world_size > 1:
            dist.barrier()  # before rank 0 removes the directory
    if rank == 0:
        print(f"world {info.world_size} on {device}, {args.rounds} rounds of {args.block} steps per mode; "
              "throughput: bare's step time over the mode's in the same round, median (and range) "
              "over rounds")
        print("| mode | ms per step (median block) | throughput | range | steps saved |")
        print("|---|---|---|---|---|")
        for mode in MODES:
            ratios = [b / m for b, m in zip(blocks["bare"], blocks[mode], strict=True)]
            print(f"| {mode} | {statistics.median(blocks[mode]) * 1e3:.1f} | "
                  f"{statistics.median(ratios):.3f} | {min(ratios):.3f}-{max(ratios):.3f} | "
                  f"{saved[mode]} of {args.rounds * args.block} |")
    lockstep.shutdown_distributed()


if __name__ == "__main__":
    main()
