"""Part ``fsdp``: fully_shard at world 2 on one device vs one process, and memory vs ZeRO-3's formula.

SGD with momentum, not Adam: Adam turns a rounding difference in a near-zero gradient into a
whole step of either sign, so equality with one process could only be checked loosely. The
formula is then (4 + 4 + 4)Ψ/N (fp32 shard, gradient shard, momentum shard), ZeRO-3's
(2 + 2 + K)Ψ/N with fp32 weights and K = 4.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import lockstep
from gpu_parts.common import Config, Section, batch_of, deterministic, lm_loss, spawn_shared, transformer

__all__ = ["run"]

TOL = 1e-5  # fp32; the sharded sum (reduce-scatter of two halves) rounds unlike one full batch
BYTES = 12  # per parameter held: fp32 shard, gradient, momentum


def _state_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    def size(ts) -> int:
        return sum(t.numel() * t.element_size() for t in ts if isinstance(t, torch.Tensor))

    params = list(model.parameters())
    return {"params": size(params), "grads": size(p.grad for p in params if p.grad is not None),
            "optimizer": size(v for st in opt.state.values() for v in st.values()
                              if isinstance(v, torch.Tensor) and v.dim() > 0)}


def worker(rank: int, cfg: Config, backend: str) -> dict:
    deterministic(cfg)
    cfg = dataclasses.replace(cfg, dtype_name="float32")  # the formula counts fp32 bytes
    lockstep.init_distributed(backend=backend, device=cfg.device)
    model = transformer(cfg)
    psi = sum(p.numel() for p in model.parameters())
    unit_params = sum(p.numel() for p in model.blocks.layers[0].parameters())
    for block in model.blocks.layers:
        lockstep.fully_shard(block, reshard_after_forward=True)
    lockstep.fully_shard(model, reshard_after_forward=True)  # ZeRO-3 traffic, as measured before
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9)
    if cfg.cuda:
        torch.cuda.reset_peak_memory_stats(cfg.device)
    for step in range(cfg.check_steps):
        x, y = batch_of(cfg, step, rank)
        opt.zero_grad(set_to_none=False)
        lm_loss(model(x), y).backward()
        opt.step()
    held = _state_bytes(model, opt)
    peak = torch.cuda.max_memory_allocated(cfg.device) if cfg.cuda else None
    shards = {n: p.detach().clone() for n, p in model.named_parameters()}
    gathered = [None, None] if rank == 0 else None
    dist.gather_object({n: t.cpu() for n, t in shards.items()}, gathered, dst=0)
    out = {"psi": psi, "unit_params": unit_params, "held": held, "peak": peak}
    if rank == 0:  # one process, the two ranks' batches as one
        ref = transformer(cfg)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
        for step in range(cfg.check_steps):
            xs, ys = zip(*(batch_of(cfg, step, r) for r in range(2)))
            ref_opt.zero_grad()
            lm_loss(ref(torch.cat(xs)), torch.cat(ys)).backward()
            ref_opt.step()
        worst = 0.0
        for name, p in ref.named_parameters():
            flat = torch.cat([gathered[r][name].flatten() for r in range(2)])[: p.numel()]
            worst = max(worst, (flat - p.detach().cpu().flatten()).abs().max().item())
        out["max_diff"] = worst
    dist.barrier()
    return out


def run(cfg: Config) -> Section:
    section = Section("fsdp", "fully_shard at world 2 on one device: vs one process, memory vs ZeRO-3")
    results = spawn_shared(worker, cfg, section)
    diff = results[0]["max_diff"]
    section.lines.append(f"SGD with momentum, fp32, {cfg.check_steps} steps; reference: one process on both ranks' "
                         f"batches. Largest parameter difference {diff:.3g} (tolerance {TOL:g}): "
                         f"{section.check(diff <= TOL, f'fsdp differs from one process by {diff:.3g}')}")
    section.lines.append("")
    rows = []
    for rank, r in enumerate(results):
        psi, held = r["psi"], r["held"]
        formula = BYTES * psi / 2
        total = sum(held.values())
        peak = "n/a (CPU)" if r["peak"] is None else f"{r['peak'] / 2**20:.0f}"
        bound = (formula + 2 * 4 * r["unit_params"]) / 2**20  # a unit gathered, one prefetched
        rows.append([rank, f"{psi / 1e6:.3g}M", f"{total / 2**20:.4g}", f"{formula / 2**20:.4g}",
                     total / formula, peak, f"{bound:.4g}"])
    section.table(["rank", "Ψ", "held MiB (shards + grads + momentum)", "12Ψ/N MiB", "held / formula",
                   "peak MiB (max_memory_allocated)", "12Ψ/N + 2 gathered units MiB (peak adds activations)"], rows)
    section.data["ranks"] = results
    return section
