"""Every command that docs/doctor.md and docs/plan.md show runs, exactly as written.

A command is a line of a fenced block (```bash, a bare fence, or a ```text block's ``$ `` line)
that starts with ``lockstep doctor``, ``lockstep plan`` or ``python benchmarks/`` (after
``NAME=value`` settings), or an inline code span on one line that starts with ``lockstep
doctor``/``lockstep plan`` and has at least three arguments (``lockstep doctor --dp-vs-ddp`` in a
sentence names a mode, not a command). Install lines and the pytest line are not commands of the
feature. A fenced ```python block whose first line is ``# NAME.py`` is the file a command reads
(``mlp_models.py``).

They run in document order in one folder (so ``lockstep plan doctor/world1/profile.json`` reads
what the doctor wrote), through ``bash`` with a ``lockstep`` on ``PATH`` that is this checkout's,
and must exit 0 without a traceback. The first doctor command and every command that takes
seconds run in the slow tier (``python -m pytest -q -m slow``, which CI runs); the other doctor
runs (about two minutes on a 2-core machine) carry the ``doc_commands`` marker::

    python -m pytest -q -m doc_commands tests/test_docs_commands.py

and the Hugging Face one the ``clients`` marker as well (it needs the clients extra).
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "docs" / "doctor.md", ROOT / "docs" / "plan.md"]
COMMAND = re.compile(r"^(?:[A-Z_]+=\S+ )*(?:lockstep (?:doctor|plan)|python benchmarks/)")
INLINE = re.compile(r"`(lockstep (?:doctor|plan) [^`]+)`")
FILE_BLOCK = re.compile(r"^# (\w+\.py)$")
TIMEOUT_S = 420
# Doctor runs beyond the first: each is two profiled trainings (about 30 s here).
LONG = "lockstep doctor --"


@dataclass(frozen=True)
class Command:
    page: str
    line: int
    text: str

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"


def _blocks(page: Path) -> list[tuple[int, str, list[str]]]:
    """Fenced blocks: (line of the fence, its language, its lines)."""
    found, lines, i = [], page.read_text().splitlines(), 0
    while i < len(lines):
        fence = lines[i].strip()
        if fence.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```"))
            found.append((i + 1, fence[3:].strip(), lines[i + 1 : end]))
            i = end
        i += 1
    return found


def commands(page: Path) -> list[Command]:
    """The page's commands in document order (see the module docstring)."""
    name, found = page.name, []
    fenced = set()
    for start, lang, body in _blocks(page):
        fenced.update(range(start, start + len(body) + 2))
        if lang == "python":
            continue
        for k, raw in enumerate(body):
            line = raw.strip()
            if lang == "text":
                if not line.startswith("$ "):
                    continue
                line = line[2:]
            if COMMAND.match(line):
                found.append(Command(name, start + 1 + k, line))
    for number, raw in enumerate(page.read_text().splitlines(), 1):
        if number in fenced:
            continue
        for match in INLINE.finditer(raw):
            if len(shlex.split(match.group(1))) >= 5:
                found.append(Command(name, number, match.group(1)))
    return sorted(found, key=lambda c: c.line)


def script_files(page: Path) -> dict[str, str]:
    """``# NAME.py`` python blocks: the files the page's commands read."""
    out = {}
    for _, lang, body in _blocks(page):
        if lang == "python" and body and (m := FILE_BLOCK.match(body[0].strip())):
            out[m.group(1)] = "\n".join(body) + "\n"
    return out


def _unique(found: list[Command]) -> list[Command]:
    """Each command once, where it first appears (plan.md repeats the doctor's first)."""
    seen: set[str] = set()
    return [c for c in found if not (c.text in seen or seen.add(c.text))]


ALL = _unique([c for page in PAGES for c in commands(page)])
FIRST_DOCTOR = next(c for c in ALL if c.text.startswith("lockstep doctor"))


def _long(command: Command) -> bool:
    """A doctor run beyond the first, or a command reading what one wrote (its ``--out-dir``)."""
    if LONG in command.text and command != FIRST_DOCTOR:
        return True
    outs = [m.group(1) for c in ALL if LONG in c.text and c != FIRST_DOCTOR
            for m in [re.search(r"--out-dir (\S+)", c.text)] if m]
    return any(f"{out}/" in command.text for out in outs)


def _marks(command: Command) -> list[pytest.MarkDecorator]:
    marks = [pytest.mark.multirank, pytest.mark.slow]
    if _long(command):
        marks.append(pytest.mark.doc_commands)
    if "hf_trainer" in command.text or "lightning" in command.text:
        marks.append(pytest.mark.clients)
    return marks


def test_the_pages_show_the_commands_this_test_runs():
    texts = [c.text for c in ALL]
    assert FIRST_DOCTOR.text == "lockstep doctor --nproc-per-node 2 examples/train_gpt.py --max-steps 30"
    assert any(t.startswith("lockstep plan --params 1.3B") for t in texts)
    assert any("--dp-vs-ddp" in t and "mlp_models.py" in t for t in texts)
    assert "lockstep doctor --dp-vs-ddp" not in texts  # a mode named in a sentence
    assert "mlp_models.py" in script_files(PAGES[0])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder for every command: the repository's folders linked in, a ``lockstep`` shim."""
    folder = tmp_path_factory.mktemp("docs_commands")
    for name in ("examples", "tests", "benchmarks"):
        (folder / name).symlink_to(ROOT / name)
    for page in PAGES:
        for name, text in script_files(page).items():
            (folder / name).write_text(text)
    shim = folder / ".bin" / "lockstep"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m lockstep "$@"\n')
    shim.chmod(shim.stat().st_mode | stat.S_IXUSR)
    return folder


def _run(command: Command, folder: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{folder / '.bin'}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": "1"}
    return subprocess.run(["bash", "-c", command.text], cwd=folder, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S, check=False)


@pytest.mark.parametrize("command", [pytest.param(c, id=c.name, marks=_marks(c)) for c in ALL])
def test_documented_command_runs_as_written(command: Command, workdir: Path, request: pytest.FixtureRequest):
    if _long(command) and "doc_commands" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("a long doctor run: python -m pytest -q -m doc_commands tests/test_docs_commands.py")
    if "hf_trainer" in command.text:
        pytest.importorskip("transformers", reason="needs the clients extra")
    done = _run(command, workdir)
    out = done.stdout + done.stderr
    assert done.returncode == 0, f"{command.name}: `{command.text}` exited {done.returncode}:\n{out[-4000:]}"
    assert "Traceback (most recent call last)" not in out, out[-4000:]
