"""GPU acceptance in one command: every GPU claim of lockstep measured, one report written.

Usage::

    python benchmarks/gpu_acceptance.py                      # every part, on cuda:0
    python benchmarks/gpu_acceptance.py --only ddp streams   # some parts (each under 10 minutes)
    python benchmarks/gpu_acceptance.py --dry-run            # every part's plumbing on CPU, tiny sizes

Parts (see docs/benchmarks.md for what each figure is compared to, and its target):

- ``env``: GPU, driver, CUDA, torch, NCCL versions;
- ``tests``: the GPU-marked tests, pass/fail per test;
- ``ddp``: a ~110M-parameter transformer in bf16: lockstep/bare and lockstep/torch DDP at world 1
  (alternating rounds), and two processes sharing the GPU, parameters bitwise equal to torch DDP;
- ``streams``: gradients made on non-default CUDA streams, bucket view on and off, ``no_sync``,
  each bitwise against torch's DDP;
- ``dp``: DataParallel over ``[gpu, gpu]`` and ``[gpu, 'cpu']`` against the bare module;
- ``compile``: lockstep DDP eager and compiled against torch's compiled DDP;
- ``doctor``: the profiler's overhead (CUDA events on vs off) and ``lockstep doctor`` end to end;
- ``fsdp``: ``fully_shard`` at world 2 against one process, and memory per rank against 16Ψ/N;
- ``checkpoint``: the stall of ``Checkpointer.save()`` with the state on the GPU.

It writes ``docs/gpu-acceptance.md`` (every table) and ``docs/gpu-acceptance.json`` (or the
``--report`` path), merging with a report already there so parts can run in separate calls,
and prints a summary. The exit status is 1 when a claim fails. A dry run writes to a temporary
report unless ``--report`` is given, and never writes a figure as a GPU one.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
from gpu_parts.common import Config, Section

PARTS = ["env", "tests", "ddp", "streams", "dp", "compile", "doctor", "fsdp", "checkpoint"]
REPO = Path(__file__).resolve().parent.parent
DEFAULT_REPORT = REPO / "docs" / "gpu-acceptance.md"


def run_part(name: str, cfg: Config) -> dict:
    """Run one part; an exception becomes a failed part with its traceback, not a lost run."""
    module = importlib.import_module(f"gpu_parts.{name}_part")
    start = time.perf_counter()
    try:
        section: Section = module.run(cfg)
    except Exception as exc:  # noqa: BLE001 - report it and go on with the other parts
        section = Section(name, name)
        section.failures.append(f"part raised {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        section.lines += ["```text", traceback.format_exc()[-3000:], "```", ""]
    return {"name": name, "title": section.title, "lines": section.lines, "data": section.data,
            "failures": section.failures, "notes": section.notes, "seconds": time.perf_counter() - start,
            "dry_run": cfg.dry_run, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def render(parts: dict[str, dict]) -> str:
    """The markdown report, parts in the canonical order."""
    dry = any(p["dry_run"] for p in parts.values())
    out = ["# GPU acceptance report", ""]
    if dry:
        out += ["**Dry run on CPU: plumbing only. No figure below is a GPU figure.**", ""]
    out += ["Written by `python benchmarks/gpu_acceptance.py` (see docs/benchmarks.md for each target).", "",
            "| part | status | minutes | run at |", "|---|---|---|---|"]
    for name in PARTS:
        if name in parts:
            p = parts[name]
            status = "pass" if not p["failures"] else f"**FAIL** ({len(p['failures'])})"
            out.append(f"| [{name}](#{name}) | {status} | {p['seconds'] / 60:.1f} | {p['when']} |")
    out.append("")
    for name in PARTS:
        if name not in parts:
            continue
        p = parts[name]
        out += [f"## {name}", "", f"**{p['title']}**", ""]  # heading = anchor the summary links to
        out += p["lines"]
        out += [f"- {note}" for note in p["notes"]]
        out += [f"- **failed:** {f}" for f in p["failures"]]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=PARTS, help="run these parts (default: all)")
    parser.add_argument("--dry-run", action="store_true", help="CPU, gloo, tiny sizes: the plumbing only")
    parser.add_argument("--report", type=Path, help=f"markdown report path (default {DEFAULT_REPORT})")
    parser.add_argument("--fresh", action="store_true", help="do not merge with an existing report")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device: run with --dry-run to test the plumbing on CPU")
    report = args.report
    if report is None:
        report = Path(tempfile.mkdtemp()) / "gpu-acceptance.md" if args.dry_run else DEFAULT_REPORT
    data_path = report.with_suffix(".json")
    parts: dict[str, dict] = {}
    if data_path.exists() and not args.fresh:
        old = json.loads(data_path.read_text())
        parts = {k: v for k, v in old.get("parts", {}).items() if v.get("dry_run") == args.dry_run}
    cfg = Config.make(args.dry_run, str(REPO))
    for name in args.only or PARTS:
        print(f"[gpu_acceptance] {name} ...", flush=True)
        parts[name] = result = run_part(name, cfg)
        print(f"[gpu_acceptance] {name}: {'pass' if not result['failures'] else 'FAIL'} "
              f"({result['seconds']:.0f}s)", flush=True)
        report.parent.mkdir(parents=True, exist_ok=True)  # written after every part: a cut-off run keeps its figures
        report.write_text(render(parts))
        data_path.write_text(json.dumps({"parts": parts}, indent=1, default=str))
    failed = {n: p["failures"] for n, p in parts.items() if p["failures"]}
    print(f"\nreport: {report}\ndata:   {data_path}")
    for name in PARTS:
        if name in parts:
            print(f"  {name:<11} {'FAIL: ' + '; '.join(failed[name])[:200] if name in failed else 'pass'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
