"""Train a small character-level GPT on Python's standard library, data-parallel on N workers.

The same file runs unchanged in every way a job starts::

    lockstep run --nproc-per-node 2 examples/train_gpt.py     # 2 CPU workers, or one per GPU
    torchrun --nproc-per-node 2 examples/train_gpt.py          # torch's own launcher
    srun -n 4 python examples/train_gpt.py                     # SLURM
    python examples/train_gpt.py                               # a world of one

Rank 0 shows a progress bar with the loss and tokens/s, evaluates the validation loss on
held-out standard-library files, and at the end prints a summary and writes ``loss.png`` and
``metrics.json`` to ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from chargpt import GPT, BlockDataset, GPTConfig, Vocab, load_corpus
from torch.utils.data import Subset

import lockstep

# --grad-reduce: (hook, state factory). bf16-mixed is what DDP's mixed_precision= installs
# (torch's order: sum in bf16); bf16-fp32acc is what DDP's reduce_dtype=torch.bfloat16 installs.
GRAD_REDUCE = {
    "fp32": (lockstep.comm.uncompressed_hook, lockstep.CommState),
    "bf16": (lockstep.comm.bf16_compress_hook, lockstep.CommState),
    "bf16-mixed": (lockstep.comm.reduce_dtype_hook,
                   lambda: lockstep.comm.ReduceDtypeState(reduce_dtype=torch.bfloat16)),
    "bf16-fp32acc": (lockstep.comm.bf16_fp32_accumulate_hook, lockstep.CommState),
}


def build_parser() -> argparse.ArgumentParser:
    """The demo's flags; ``--help`` shows each with its default."""
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add = parser.add_argument
    add("--max-steps", type=int, default=250, help="optimizer steps")
    add("--batch-size", type=int, default=16, help="sequences per step on each worker")
    add("--block-size", type=int, default=128, help="characters of context")
    add("--n-layer", type=int, default=4, help="transformer blocks")
    add("--n-head", type=int, default=4, help="attention heads per block")
    add("--n-embd", type=int, default=128, help="width of the model")
    add("--lr", type=float, default=3e-3, help="peak learning rate (AdamW; warmup, then cosine)")
    add("--warmup-steps", type=int, default=20, help="steps of linear learning-rate warmup")
    add("--eval-interval", type=int, default=50, help="steps between validation runs")
    add("--eval-blocks", type=int, default=128, help="held-out sequences per validation run")
    add("--log-interval", type=int, default=10, help="steps between loss averages over ranks")
    add("--max-files", type=int, default=None, help="read only the first N stdlib files; None reads them all")
    add("--sample-chars", type=int, default=200, help="characters to generate at the end")
    add("--device", default=None, help="e.g. cpu; None picks this worker's GPU, else the CPU")
    add("--seed", type=int, default=0, help="seed of the initial weights and the data order")
    add("--grad-reduce", choices=sorted(GRAD_REDUCE), default="fp32",
        help="how gradients are averaged over workers (docs/compression-and-local-sgd.md)")
    add("--out-dir", type=Path, default=Path("runs/demo"), help="where metrics.json and loss.png go")
    add("--checkpoint-dir", type=Path, default=None,
        help="save checkpoints here and resume from the newest at start; None saves nothing")
    add("--checkpoint-every", type=int, default=None,
        help="steps between checkpoints (with --checkpoint-dir); None: 50")
    add("--checkpoint-max-overhead", type=float, default=None,
        help="skip saves that come sooner than this share of the time allows, e.g. 0.05 with "
             "--checkpoint-every 1 (lockstep.Checkpointer's max_overhead); None: no pacing")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("max_steps", "batch_size", "block_size", "eval_interval", "log_interval", "eval_blocks",
                 "checkpoint_every", "max_files", "n_layer", "n_head", "n_embd"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    if args.warmup_steps < 0:
        parser.error(f"--warmup-steps must be at least 0, got {args.warmup_steps}")
    if args.n_embd % args.n_head:
        parser.error(f"--n-embd {args.n_embd} must be a multiple of --n-head {args.n_head}")
    if args.checkpoint_dir is None:
        given = [flag for flag, value in (("--checkpoint-every", args.checkpoint_every),
                                          ("--checkpoint-max-overhead", args.checkpoint_max_overhead))
                 if value is not None]
        if given:
            parser.error(f"{' and '.join(given)} need{'s' * (len(given) == 1)} --checkpoint-dir "
                         "(nothing is saved without it)")
    if args.checkpoint_every is None:
        args.checkpoint_every = 50
    share = args.checkpoint_max_overhead
    if share is not None and not 0 < share <= 1:
        parser.error(f"--checkpoint-max-overhead must be in (0, 1], e.g. 0.05 for 5%, got {share}")
    return args


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak: a multiplier for LambdaLR."""
    if step < args.warmup_steps:
        return (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


@torch.no_grad()
def evaluate(rt: lockstep.Runtime, model: torch.nn.Module, loader, total: int) -> float:
    """Mean validation loss over the held-out sequences (the first ``--eval-blocks``), each
    counted exactly once whatever the number of workers."""
    model.eval()
    losses = []
    for x, y in loader:
        logits = model(x)
        per_token = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")
        losses.append(per_token.mean(dim=1))
    model.train()
    # Ranks' shards are padded to equal length; gather_for_eval drops the repeats.
    return rt.gather_for_eval(torch.cat(losses), total).mean().item()


def build(rt: lockstep.Runtime, args: argparse.Namespace):
    """The data loaders and the (wrapped) model, the same on every rank."""
    vocab = Vocab()
    corpus = load_corpus(args.max_files)
    train_set = BlockDataset(vocab.encode(corpus.train_text()), args.block_size)
    val_blocks = BlockDataset(vocab.encode(corpus.val_text()), args.block_size)
    if not len(val_blocks):
        raise SystemExit(
            f"train_gpt.py: the validation files hold no whole --block-size {args.block_size} "
            "sequence: lower --block-size, or raise --max-files (more files, more validation text)"
        )
    val_set = Subset(val_blocks, range(min(args.eval_blocks, len(val_blocks))))
    train_loader = rt.dataloader(train_set, args.batch_size, shuffle=True, seed=args.seed, drop_last=True)
    if not len(train_loader):  # every batch dropped: the training loop would wait for one forever
        raise SystemExit(
            f"train_gpt.py: each of the {rt.world_size} workers gets "
            f"{len(train_loader.sampler)} training sequences of --block-size {args.block_size}, "
            f"fewer than --batch-size {args.batch_size}: lower --batch-size or --block-size, raise "
            "--max-files, or use fewer workers"
        )
    val_loader = rt.dataloader(val_set, args.batch_size)
    rt.print(
        f"data: {len(corpus.train_files)} train / {len(corpus.val_files)} validation files from "
        f"{corpus.root}, {len(train_set) * args.block_size:,} train characters, vocab {len(vocab)}"
    )
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP broadcasts anyway)
    cfg = GPTConfig(len(vocab), args.block_size, args.n_layer, args.n_head, args.n_embd)
    model = rt.wrap(GPT(cfg))
    state = None
    if isinstance(model, lockstep.DistributedDataParallel):  # (a world of one reduces nothing)
        hook, make_state = GRAD_REDUCE[args.grad_reduce]
        state = make_state()
        model.register_comm_hook(state, hook)
    return vocab, train_loader, val_loader, val_set, model, state


def batches(loader, epoch: int = 0):
    """Endless ``(epoch, batch)`` pairs, reshuffled each epoch, from ``epoch`` on.

    A loader restored from a checkpoint keeps its place inside that first epoch.
    """
    while True:
        loader.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch
        epoch += 1


def train(rt: lockstep.Runtime, args: argparse.Namespace) -> dict | None:
    vocab, train_loader, val_loader, val_set, model, comm = build(rt, args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_at(step, args))
    tokens_per_step = args.batch_size * args.block_size * rt.world_size
    ckpt, objects, first, start_epoch = None, {}, 1, 0
    if args.checkpoint_dir is not None:
        # Asynchronous saves; one still being written when the next is due is skipped (and,
        # with --checkpoint-max-overhead, one that comes sooner than that share allows).
        ckpt = lockstep.Checkpointer(args.checkpoint_dir, keep=2, when_busy="skip",
                                     max_overhead=args.checkpoint_max_overhead)
        objects = {"model": model, "optimizer": optimizer, "scheduler": schedule, "loader": train_loader}
        resumed = ckpt.restore(**objects)
        if resumed is not None:
            first, start_epoch = resumed.step + 1, resumed.epoch or 0
            if first > args.max_steps:
                # A finished run: the same command again (a supervisor's retry) succeeds at once,
                # so that a launcher with --max-restarts does not start it over and over.
                rt.print(f"{args.checkpoint_dir} already holds step {resumed.step} of --max-steps "
                         f"{args.max_steps}: nothing to train (raise --max-steps to train on)")
                return None
            rt.print(f"resumed from {resumed.path} at step {resumed.step}")
    history = {"train": [], "val": [(first - 1, evaluate(rt, model, val_loader, len(val_set)))]}
    shown = {"loss": "-", "tok/s": "-", "val_loss": f"{history['val'][0][1]:.3f}"}
    bar = rt.progress(total=args.max_steps, desc=f"training on {rt.world_size} worker(s)", unit="step")
    train_time, window_loss, window_steps, clock = 0.0, 0.0, 0, time.perf_counter()
    bar.update(first - 1)
    for step, (epoch, (x, y)) in enumerate(batches(train_loader, start_epoch), start=first):
        loss = F.cross_entropy(model(x).transpose(1, 2), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        window_loss, window_steps = window_loss + loss.item(), window_steps + 1
        evaluating = step % args.eval_interval == 0 or step == args.max_steps
        if evaluating or step == 1 or step % args.log_interval == 0:
            mean_loss = rt.all_reduce(window_loss / window_steps)  # every rank's batches
            elapsed, clock = time.perf_counter() - clock, time.perf_counter()
            train_time += elapsed
            history["train"].append((step, mean_loss))
            shown["loss"] = f"{mean_loss:.3f}"
            shown["tok/s"] = f"{window_steps * tokens_per_step / elapsed:,.0f}"
            window_loss, window_steps = 0.0, 0
        if evaluating:
            history["val"].append((step, evaluate(rt, model, val_loader, len(val_set))))
            shown["val_loss"] = f"{history['val'][-1][1]:.3f}"
            clock = time.perf_counter()  # evaluation is not training time
        if ckpt is not None and (step % args.checkpoint_every == 0 or step == args.max_steps):
            # The last step's checkpoint is never skipped: a blocking save never is.
            ckpt.save(step, epoch=epoch, blocking=step == args.max_steps, **objects)
        bar.set_postfix(shown, refresh=False)
        bar.update()
        if step == args.max_steps:
            break
    bar.close()
    if ckpt is not None:
        ckpt.wait()  # the last checkpoint is on disk before the run reports
    return {
        "history": history, "train_time": train_time, "tokens_per_step": tokens_per_step,
        "first_step": first, "steps_run": args.max_steps - first + 1,
        "model": rt.unwrap(model), "vocab": vocab,
        "grad_bytes_per_step": comm.counter.bytes_per_step() if comm is not None else 0.0,
    }


def report(rt: lockstep.Runtime, args: argparse.Namespace, result: dict, wall: float) -> None:
    """Rank 0: print the summary, write metrics.json and loss.png, show a sample."""
    history = result["history"]
    tokens = result["steps_run"] * result["tokens_per_step"]  # this run's (a resumed run starts later)
    metrics = {
        "world_size": rt.world_size,
        "device": str(rt.device),
        "parameters": sum(p.numel() for p in result["model"].parameters()),
        "steps": args.max_steps,
        "tokens_per_step": result["tokens_per_step"],
        "tokens_seen": tokens,
        "train_time_s": round(result["train_time"], 2),
        "wall_time_s": round(wall, 2),
        "tokens_per_s": round(tokens / result["train_time"], 1),
        "resumed_at_step": result["first_step"] - 1 if result["first_step"] > 1 else None,
        # A world of one reduces nothing: no reduction to name (the flag stays in "args").
        "grad_reduce": args.grad_reduce if rt.world_size > 1 else None,
        "grad_bytes_per_step": result["grad_bytes_per_step"],
        "first_step_train_loss": history["train"][0][1],
        "final_train_loss": history["train"][-1][1],
        "initial_val_loss": history["val"][0][1],
        "final_val_loss": history["val"][-1][1],
        "train_loss": history["train"],
        "val_loss": history["val"],
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    plot_losses(history, args.out_dir / "loss.png", rt.world_size)
    print(
        f"\nworld size {rt.world_size} on {rt.device} | {metrics['parameters']:,} parameters | "
        f"{result['steps_run']} steps, {tokens:,} tokens in {result['train_time']:.1f}s of training "
        f"({metrics['tokens_per_s']:,.0f} tokens/s), {wall:.1f}s in all\n"
        f"train loss {metrics['first_step_train_loss']:.3f} -> {metrics['final_train_loss']:.3f} | "
        f"validation loss {metrics['initial_val_loss']:.3f} -> {metrics['final_val_loss']:.3f}\n"
        f"wrote {args.out_dir / 'metrics.json'} and {args.out_dir / 'loss.png'}"
    )
    if args.sample_chars > 0:
        vocab, model = result["vocab"], result["model"]
        model.eval()
        prompt = vocab.encode("def ").unsqueeze(0).to(rt.device)
        torch.manual_seed(args.seed)
        print("sample:\n" + vocab.decode(model.generate(prompt, args.sample_chars)[0]))


def plot_losses(history: dict, path: Path, world_size: int) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(*zip(*history["train"]), label="train (mean over ranks)")
    ax.plot(*zip(*history["val"]), marker="o", label="validation (held-out files)")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/char)", title=f"char GPT, {world_size} worker(s)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    with lockstep.Runtime(device=args.device) as rt:
        result = train(rt, args)
        if result is not None and rt.is_main:
            report(rt, args, result, time.perf_counter() - start)
        rt.barrier()  # nobody leaves while rank 0 still writes


if __name__ == "__main__":
    main()
