"""Part ``dp``: DataParallel with the GPU listed twice, and with a GPU and the CPU."""

from __future__ import annotations

import torch
from torch import nn

import lockstep
from gpu_parts.common import Config, Section

__all__ = ["run"]


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 8)).to(device)


def _compare(devices: list[str], source: str) -> tuple[bool, bool, str]:
    """Outputs and gradients of DataParallel over ``devices`` vs the bare module (allclose: a CPU
    replica sums in another order than the GPU)."""
    bare, wrapped = _model(source), _model(source)
    dp = lockstep.DataParallel(wrapped, device_ids=devices)
    x = torch.randn(16, 64, generator=torch.Generator().manual_seed(2)).to(source)
    out_bare, out_dp = bare(x), dp(x)
    out_ok = torch.allclose(out_dp.to(source), out_bare, rtol=1e-4, atol=1e-5)
    out_bare.square().sum().backward()
    out_dp.to(source).square().sum().backward()
    grad_ok = all(torch.allclose(p.grad, q.grad, rtol=1e-4, atol=1e-5)
                  for p, q in zip(bare.parameters(), wrapped.parameters()))
    return out_ok, grad_ok, ""


def run(cfg: Config) -> Section:
    section = Section("dp", "DataParallel: outputs and gradients vs the bare module")
    gpu = cfg.device
    lists = [[gpu, gpu], [gpu, "cpu"]] if cfg.cuda else [["cpu", "cpu"]]
    if not cfg.cuda:
        section.notes.append("dry run: ['cpu', 'cpu'] only; the GPU lists need CUDA")
    rows = []
    for devices in lists:
        try:
            out_ok, grad_ok, _ = _compare(devices, devices[0])
            rows.append([str(devices), section.check(out_ok, f"dp {devices}: outputs differ"),
                         section.check(grad_ok, f"dp {devices}: gradients differ"), "-"])
        except (ValueError, RuntimeError, TypeError) as exc:  # a mixed list may be refused: say how
            message = str(exc).splitlines()[0][:160]
            rows.append([str(devices), "refused", "refused", message])
            section.notes.append(f"{devices} refused: {message}")
    section.table(["device_ids", "outputs match (allclose)", "gradients match (allclose)", "error"], rows)
    section.data["rows"] = rows
    return section
