"""``lockstep run``'s command-line flags: torchrun's, in both spellings, with their defaults.

Only the parser lives here; what the values mean and whether they can work is
:mod:`~lockstep.launcher.launch_plan`'s business.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from lockstep.launcher.rendezvous import LOOPBACK_HOST

__all__ = ["add_run_arguments"]

# torchrun's flags: (name, argparse options). Each is accepted as --a-b and --a_b.
_FLAGS: tuple[tuple[str, dict], ...] = (
    ("nproc-per-node", {"default": "1", "metavar": "N|auto|cpu|gpu",
                            "help": "workers on this machine; auto: one per GPU, else 2; "
                                    "cpu: one per usable core; gpu: one per GPU"}),
    ("nnodes", {"default": "1", "metavar": "N|MIN:MAX", "help": "number of machines in the job"}),
    ("node-rank", {"type": int, "default": 0, "metavar": "R",
                       "help": "this machine's rank (static rendezvous; c10d numbers machines)"}),
    ("rdzv-endpoint", {"default": "", "metavar": "HOST:PORT",
                           "help": "where the machines meet; needed with --nnodes > 1"}),
    ("rdzv-backend", {"default": "c10d", "choices": ["c10d", "static"], "help": "rendezvous backend"}),
    ("rdzv-id", {"default": "none", "help": "job id shared by every machine of the job"}),
    ("rdzv-conf", {"default": "", "metavar": "K=V,...", "help": "extra rendezvous settings"}),
    ("master-addr", {"default": LOOPBACK_HOST, "help": "static rendezvous host"}),
    ("master-port", {"type": int, "default": None, "help": "static rendezvous port"}),
    ("max-restarts", {"type": int, "default": 0, "metavar": "K",
                          "help": "restart every worker up to K times after a failure"}),
    ("monitor-interval", {"type": float, "default": 0.1, "metavar": "SECONDS",
                              "help": "how often the launcher checks on its workers"}),
    ("local-addr", {"default": None, "help": "this machine's address as other machines reach it"}),
    ("log-dir", {"default": None, "help": "keep every worker's stdout/stderr/error files here"}),
    ("virtual-shards", {"type": int, "default": None, "metavar": "V",
                            "help": "VirtualShardDDP's shards: check the world divides V, "
                                    "pass V to the workers (LOCKSTEP_VIRTUAL_SHARDS)"}),
    ("survivors", {"action": "store_true",
                   "help": "when a worker or a machine dies the others keep training and a "
                           "replacement joins (the script uses lockstep.Survivors)"}),
    ("node-timeout", {"type": float, "default": None, "metavar": "SECONDS",
                      "help": "with --survivors on several machines: a machine whose launcher "
                              "is silent this long is counted lost (default 10)"}),
    ("spares", {"type": int, "default": None, "metavar": "K",
                "help": "with --survivors: K warm spare workers, started with the others and "
                        "waiting with their imports done, to replace a failed one at once"}),
    ("no-fork", {"action": "store_true",
                 "help": "with --max-restarts or --spares: start every worker as a new "
                         "interpreter, not forked from a server that has imported torch"}),
    ("local-ranks-filter", {"default": "", "metavar": "R,...",
                                "help": "show only these local ranks' output on the console"}),
    ("role", {"default": "default", "help": "the workers' ROLE_NAME, as torchrun's"}),
    # torchrun's settings of its elastic agent, passed on to it (see launch_plan.agent_options)
    ("signals-to-handle", {"default": "SIGTERM,SIGINT,SIGHUP,SIGQUIT", "metavar": "SIG,...",
                           "help": "signals forwarded to the workers, as torchrun's"}),
    ("shutdown-timeout", {"type": int, "default": None, "metavar": "SECONDS",
                          "help": "wait this long for workers to stop before SIGKILL, as torchrun's"}),
    ("virtual-local-rank", {"action": "store_true",
                            "help": "LOCAL_RANK=0 in every worker, each seeing its own GPU, as torchrun's"}),
    ("numa-binding", {"default": None, "metavar": "MODE",
                      "help": "bind workers to CPUs near their GPU (node, socket, exclusive, core-complex), as torchrun's"}),
    ("duplicate-stdout-filters", {"default": "", "metavar": "A,B",
                                  "help": "also copy matching stdout lines to a file of the log dir, as torchrun's"}),
    ("duplicate-stderr-filters", {"default": "", "metavar": "A,B",
                                  "help": "also copy matching stderr lines to a file of the log dir, as torchrun's"}),
    ("event-log-handler", {"default": "null", "help": "torch's elastic event handler, as torchrun's"}),
    ("logs-specs", {"default": None, "help": "not supported: lockstep run writes the workers' logs itself"}),
    ("start-method", {"default": "spawn", "choices": ["spawn", "fork", "forkserver"],
                      "help": "accepted for torchrun's sake: a script's workers are processes "
                              "of their own (see --no-fork for restarts)"}),
)  # fmt: skip

# torchrun's output flags, accepted so its command lines run unchanged: every worker's output
# reaches the console through the relay and, with --log-dir, its files (torchrun's --tee).
_OUTPUT_FLAGS = (("-t", "--tee"), ("-r", "--redirects"))


# lockstep's own flags: torchrun has no PET_ variable for them.
_OWN = frozenset({"virtual-shards", "survivors", "node-timeout", "spares", "no-fork"})


def _from_pet(name: str, options: dict, environ: Mapping[str, str]) -> dict:
    """``options`` with the default torchrun would take from ``PET_<FLAG>`` (``PET_NNODES``,
    ``PET_NODE_RANK``...), which Kubeflow's PyTorchJob and other operators set instead of
    flags. A flag on the command line still wins, as with torchrun."""
    value = environ.get("PET_" + name.replace("-", "_").upper())
    if value is None or name in _OWN:
        return options
    if options.get("action") == "store_true":  # torchrun's check_env: "1" on, "0" off
        try:
            return {**options, "default": bool(int(value))}
        except ValueError:
            raise SystemExit(f"lockstep: PET_{name.replace('-', '_').upper()}={value!r} (torchrun's "
                             f"variable for --{name}) must be 1 or 0") from None
    return {**options, "default": value}  # argparse converts a string default with `type`


def add_run_arguments(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Add torchrun's flags (both ``--nproc-per-node`` and ``--nproc_per_node`` spellings),
    their defaults from torchrun's ``PET_`` variables where set (``environ``: ``os.environ``)."""
    env = os.environ if environ is None else environ
    for name, options in _FLAGS:
        spellings = dict.fromkeys([f"--{name}", f"--{name.replace('-', '_')}"])
        parser.add_argument(*spellings, **_from_pet(name, options, env))
    for short, long in _OUTPUT_FLAGS:
        parser.add_argument(short, long, **_from_pet(long[2:], {"default": None}, env),
                            metavar="0-3|RANK:N,...",
                            help=f"accepted as torchrun's {long}: output always reaches the "
                                 "console (prefixed) and, with --log-dir, the log files")
    switches = (
        (("--run-path", "--run_path"), "accepted as torchrun's: a script is run as `python script.py` runs it"),
        (("--standalone",), "a single-machine job on loopback (what one machine gets anyway)"),
        (("-m", "--module"), "run TRAINING_SCRIPT as a module, like python -m"),
        (("--no-python", "--no_python"), "run TRAINING_SCRIPT as an executable, not with Python"),
    )
    for spellings_, text in switches:
        flag = next(s for s in spellings_ if s.startswith("--"))[2:].replace("_", "-")
        parser.add_argument(*spellings_, **_from_pet(flag, {"action": "store_true"}, env), help=text)
    parser.add_argument("training_script", help="the script every worker runs")
    parser.add_argument(
        "training_script_args", nargs=argparse.REMAINDER, help="arguments passed on to the script"
    )
