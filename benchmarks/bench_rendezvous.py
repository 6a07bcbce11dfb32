"""Benchmark the meeting of machines: time from the last machine's start to the first step.

Two launchers on this host stand in for two machines (one worker each, gloo on loopback):
the first is started and left waiting at the rendezvous endpoint (its port answers); then the
second is started, and the clock runs until rank 0 has finished its first training step (one
DDP forward, backward and gradient all-reduce). That is what a user waits for after starting
the last machine: interpreter and torch start-up, the rendezvous, the workers' process group.
``lockstep run`` and ``torchrun`` (its c10d rendezvous) are run in alternating rounds, so
that load from other processes hits both alike; the median of the rounds is reported.

    python benchmarks/bench_rendezvous.py              # 3 rounds
    python benchmarks/bench_rendezvous.py --rounds 5
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

SCRIPT = """
import sys, time, torch, lockstep
info = lockstep.init_distributed()
model = lockstep.DistributedDataParallel(torch.nn.Linear(8, 1))
model(torch.ones(4, 8)).sum().backward()
if info.rank == 0:
    with open(sys.argv[1], "w") as fh:
        fh.write(repr(time.time()))
lockstep.shutdown_distributed()
"""

LAUNCHERS = {
    "lockstep run": [sys.executable, "-m", "lockstep", "run"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", "c10d"],
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the first launcher ended early with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing listened on port {port} within {timeout:.0f} s")


def _one_round(name: str, script: str, stamp: str) -> float:
    port = _free_port()
    cmd = [*LAUNCHERS[name], "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"bench{port}", script, stamp]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Output to a file: a pipe nobody reads could fill and block the first launcher.
    with tempfile.TemporaryFile("w+") as log:
        first = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            _wait_for_port(port, first)
            time.sleep(1.0)  # the first machine is waiting at the rendezvous
            start = time.time()
            last = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True,
                                  timeout=300)
            first.wait(timeout=120)
        finally:
            first.kill()
    if last.returncode != 0 or first.returncode != 0:
        raise RuntimeError(f"{name}: exit {first.returncode}/{last.returncode}\n{last.stderr[-2000:]}")
    with open(stamp) as fh:
        first_step = float(fh.read())
    os.remove(stamp)
    return first_step - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    times: dict[str, list[float]] = {name: [] for name in LAUNCHERS}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "first_step.py")
        with open(script, "w") as fh:
            fh.write(SCRIPT)
        for _ in range(args.rounds):
            for name in LAUNCHERS:
                times[name].append(_one_round(name, script, os.path.join(tmp, "stamp")))
    print(f"{args.rounds} rounds, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}\n")
    print("| launcher | median s | best s | worst s |")
    print("|---|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.2f} | {min(t):.2f} | {max(t):.2f} |")


if __name__ == "__main__":
    main()
