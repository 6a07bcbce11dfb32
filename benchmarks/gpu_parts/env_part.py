"""Part ``env``: the machine and software the figures were taken on."""

from __future__ import annotations

import platform
import subprocess

import torch

from gpu_parts.common import Config, Section

__all__ = ["run"]


def _driver() -> str:
    try:
        out = subprocess.run(check=False, args=["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return "n/a (no nvidia-smi)"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "n/a"


def run(cfg: Config) -> Section:
    import lockstep

    section = Section("env", "Environment")
    cuda = torch.cuda.is_available()
    nccl = "n/a"
    if cuda:
        try:
            v = torch.cuda.nccl.version()
            nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except (RuntimeError, AttributeError) as exc:
            nccl = f"n/a ({exc})"
    info = {
        "gpu": torch.cuda.get_device_name(0) if cuda else "none (dry run on CPU)" if cfg.dry_run else "none",
        "gpu memory GiB": f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f}" if cuda else "n/a",
        "driver": _driver() if cuda else "n/a",
        "CUDA (torch built with)": torch.version.cuda or "n/a",
        "NCCL": nccl,
        "torch": torch.__version__,
        "lockstep": lockstep.__version__,
        "python": platform.python_version(),
        "CPU cores": str(__import__("os").cpu_count()),
    }
    section.table(["item", "value"], [[k, v] for k, v in info.items()])
    section.data.update(info)
    return section
