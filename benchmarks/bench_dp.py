"""Benchmark lockstep.DataParallel against torch.nn.DataParallel and the bare module, in one run.

Each configuration runs a training step (forward, loss, backward, SGD step), an inference
forward, or a batch of tiny forwards (the wrapper's fixed cost); configurations are interleaved
in rounds so that load from other processes hits them alike. Reported per step: best and median
wall-clock time, and the CPU time of this process (all threads), which on a shared CPU measures
the work done regardless of load. On CUDA, device-0 peak memory above what is resident (every
configuration's model) is reported too, and torch's DataParallel runs on as many GPUs.

    python benchmarks/bench_dp.py            # CUDA when present, else CPU device lists
    python benchmarks/bench_dp.py --quick    # a smaller model and fewer steps
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

import lockstep
from lockstep.dp import replicate


@dataclass
class Result:
    name: str
    times: list[float]
    cpu_times: list[float] = field(default_factory=list)
    peak_mib: float | None = None

    @property
    def median_ms(self) -> float:
        return statistics.median(self.times) * 1e3

    @property
    def best_ms(self) -> float:
        return min(self.times) * 1e3

    @property
    def cpu_ms(self) -> float:
        return statistics.median(self.cpu_times) * 1e3


def make_model(hidden: int, classes: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(), nn.Linear(hidden, classes)
    ).to(device)


def train_step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               balanced: bool) -> None:
    opt.zero_grad(set_to_none=True)
    loss = net(x, targets=y) if balanced else nn.functional.cross_entropy(net(x), y.to(_out_device(net)))
    loss.backward()
    opt.step()


def _out_device(net: nn.Module) -> torch.device:
    out = getattr(net, "output_device", None)
    if isinstance(out, torch.device):
        return out
    if isinstance(out, int):  # torch.nn.DataParallel keeps an index
        return torch.device("cuda", out)
    return next(net.parameters()).device


def run_rounds(configs: dict[str, Callable[[], None]], steps: int, rounds: int, cuda: bool) -> list[Result]:
    """Warm every configuration up, then time ``steps`` steps of each per round, interleaved."""
    results = {name: Result(name, []) for name in configs}
    for fn in configs.values():
        fn()
        fn()
    for _ in range(rounds):
        for name, fn in configs.items():
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(0)
                resident = torch.cuda.memory_allocated(0)  # every configuration's model and optimizer
            for _ in range(steps):
                start, cpu_start = time.perf_counter(), time.process_time()
                fn()
                if cuda:
                    torch.cuda.synchronize()
                results[name].times.append(time.perf_counter() - start)
                results[name].cpu_times.append(time.process_time() - cpu_start)
            if cuda:
                peak = (torch.cuda.max_memory_allocated(0) - resident) / 2**20
                results[name].peak_mib = max(results[name].peak_mib or 0.0, peak)
    return list(results.values())


def _torch_dp_one(src: torch.device) -> str:
    # Without CUDA torch's DataParallel wraps nothing and calls the module: not a comparison.
    return "torch DP, 1 device" if src.type == "cuda" else "torch DP (no CUDA: calls the module)"


def training_configs(devices: list[torch.device], args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """Bare module, torch's DataParallel and lockstep's, on one device and (if several) on all."""
    src = devices[0]
    x = torch.randn(args.batch, args.hidden)
    y = torch.randint(0, args.classes, (args.batch,))
    if src.type == "cuda":
        x, y = x.to(src), y.to(src)
    ids = [d.index for d in devices] if src.type == "cuda" else ["cpu"] * len(devices)
    configs: dict[str, Callable[[], None]] = {}

    def add(name: str, wrap: Callable[[nn.Module], nn.Module], balanced: bool = False) -> None:
        model = make_model(args.hidden, args.classes, src)
        net = wrap(model)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        configs[name] = lambda: train_step(net, opt, x, y, balanced)

    add("bare module", lambda m: m)
    add(_torch_dp_one(src), lambda m: nn.DataParallel(m, device_ids=ids[:1] if src.type == "cuda" else None))
    add("lockstep DP, 1 device", lambda m: lockstep.DataParallel(m, ids[:1]))
    if len(ids) > 1:
        n = len(ids)
        if src.type == "cuda":
            add(f"torch DP, {n} devices", lambda m: nn.DataParallel(m, device_ids=ids))
        add(f"lockstep DP, {n} devices", lambda m: lockstep.DataParallel(m, ids))
        add(f"lockstep DP, {n} devices, loss_fn", lambda m: lockstep.DataParallel(
            m, ids, loss_fn=nn.CrossEntropyLoss()), balanced=True)
    return configs


def inference_configs(devices: list[torch.device], args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """Forward under no_grad: lockstep's cached replicas against re-replicating every call."""
    src = devices[0]
    x = torch.randn(args.batch, args.hidden, device=src if src.type == "cuda" else "cpu")
    ids = [d.index for d in devices] if src.type == "cuda" else ["cpu"] * len(devices)
    model = make_model(args.hidden, args.classes, src).eval()
    nets = {
        "bare module": model,
        f"lockstep DP, {len(ids)} devices, cached": lockstep.DataParallel(model, ids),
        f"lockstep DP, {len(ids)} devices, no cache": lockstep.DataParallel(model, ids, cache_replicas=False),
    }
    if src.type == "cuda" and len(ids) > 1:
        nets[f"torch DP, {len(ids)} devices"] = nn.DataParallel(model, device_ids=ids)

    def infer(net: nn.Module) -> Callable[[], None]:
        def step() -> None:
            with torch.no_grad():
                net(x)
        return step

    return {name: infer(net) for name, net in nets.items()}


def replication_configs(devices: list[torch.device], args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """What DataParallel pays every training step and DDP never does: copying the model out."""
    src = devices[0]
    x = torch.randn(args.batch, args.hidden, device=src if src.type == "cuda" else "cpu")
    model = make_model(args.hidden, args.classes, src)
    ids = [d.index for d in devices] if src.type == "cuda" else ["cpu"] * len(devices)

    def forward() -> None:
        with torch.no_grad():
            model(x)

    return {"bare forward (for scale)": forward, f"replicate to {len(ids)} devices": lambda: replicate(model, ids)}


def overhead_configs(devices: list[torch.device], args: argparse.Namespace) -> dict[str, Callable[[], None]]:
    """The wrapper's fixed cost per call on one device: a tiny model, 100 forwards per step."""
    src = devices[0]
    model = nn.Linear(64, 64).to(src)
    x = torch.randn(32, 64, device=src)
    one = [src.index] if src.type == "cuda" else ["cpu"]
    nets = {
        "bare module": model,
        _torch_dp_one(src): nn.DataParallel(model, device_ids=one if src.type == "cuda" else None),
        "lockstep DP, 1 device": lockstep.DataParallel(model, one),
    }

    def hundred(net: nn.Module) -> Callable[[], None]:
        def step() -> None:
            for _ in range(100):
                net(x)
        return step

    return {name: hundred(net) for name, net in nets.items()}


def _devices_part(name: str) -> str:
    """``'2 devices'`` from ``'lockstep DP, 2 devices, loss_fn'``: which torch row to compare with."""
    parts = name.split(", ")
    return parts[1] if len(parts) > 1 else name


def print_table(title: str, results: list[Result]) -> None:
    """A markdown table of wall-clock and CPU time per step, with ratios to the bare module.

    Wall ratios use the best step (least disturbed by other processes); CPU time (all threads
    of this process, median) counts the work done whatever the machine's load, which is what
    compares fairly on a shared CPU.
    """
    base, base_cpu = results[0].best_ms, results[0].cpu_ms
    torch_dp = {_devices_part(r.name): r.best_ms for r in results if r.name.startswith("torch DP")}
    has_mem = any(r.peak_mib is not None for r in results)
    print(f"\n{title}\n")
    print("| configuration | best wall (ms) | median wall (ms) | CPU time (ms) | wall vs bare "
          "| CPU time vs bare | wall vs torch DP |" + (" device-0 peak above resident (MiB) |" if has_mem else ""))
    print("|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if has_mem else ""))
    for r in results:
        ref = torch_dp.get(_devices_part(r.name)) if r.name.startswith("lockstep") else None
        row = (f"| {r.name} | {r.best_ms:.2f} | {r.median_ms:.2f} | {r.cpu_ms:.2f} | "
               f"{r.best_ms / base:.3f}x | {r.cpu_ms / base_cpu:.3f}x | ")
        row += f"{r.best_ms / ref:.3f}x |" if ref else "- |"
        if has_mem:
            row += f" {r.peak_mib:.0f} |"
        print(row)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--classes", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per configuration per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu-devices", type=int, default=2, help="replicas on CPU when there is no GPU")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads on CPU runs (1: each replica is one core)")
    parser.add_argument("--quick", action="store_true", help="small model, few steps (smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.hidden, args.classes, args.steps, args.rounds = 64, 256, 512, 3, 2
    cuda = torch.cuda.is_available()
    if cuda:
        devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        names = ", ".join(torch.cuda.get_device_name(i) for i in range(len(devices)))
        print(f"CUDA: {len(devices)} device(s): {names}")
    else:
        torch.set_num_threads(args.threads)
        devices = [torch.device("cpu")] * args.cpu_devices
        print(f"CPU only: {args.cpu_devices} replicas on 'cpu', torch threads={torch.get_num_threads()}")
    print(f"torch {torch.__version__}; batch {args.batch}, hidden {args.hidden}, classes {args.classes}, "
          f"{args.steps} steps x {args.rounds} rounds")
    print_table("Training step (forward + cross-entropy + backward + SGD)",
                run_rounds(training_configs(devices, args), args.steps, args.rounds, cuda))
    print_table("Inference forward under torch.no_grad()",
                run_rounds(inference_configs(devices, args), args.steps, args.rounds, cuda))
    print_table("Fixed cost per call on one device: 100 forwards of Linear(64, 64), batch 32",
                run_rounds(overhead_configs(devices, args), args.steps, args.rounds, cuda))
    print_table("Copying the model to every device, as each training forward does",
                run_rounds(replication_configs(devices, args), args.steps, args.rounds, cuda))


if __name__ == "__main__":
    main()
