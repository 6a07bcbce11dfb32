"""The documentation stays true: every Python snippet runs, every documented name resolves.

Snippet convention (docs/contributing.md):

- A fenced ```python block in README.md or docs/*.md is a complete script. It runs as shown, in
  a fresh interpreter in an empty folder, on CPU, with a timeout.
- ``<!-- fragment -->`` on the line just before the fence marks an illustrative piece (a line
  out of a training loop): it must parse, and is not run. Keep these few.
- ``<!-- launch: N -->`` on the line just before the fence runs the script under
  ``lockstep run --nproc-per-node N`` instead of ``python``.
- Shell commands go in ```bash blocks and output in ```text blocks: neither runs.

Running a snippet starts a process, so those tests carry the ``multirank`` marker (the fast
tier only parses them).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SNIPPET_TIMEOUT_S = 240
# Pages and names that the docs mention and other branches are adding (the doctor, the planner,
# the torch-compatibility notes). Remove each entry as soon as it exists.
PENDING: set[str] = set()
FRAGMENT = "<!-- fragment -->"
LAUNCH = re.compile(r"<!-- launch: (\d+) -->")


@dataclass(frozen=True)
class Snippet:
    page: Path
    line: int  # of the opening fence, 1-based
    code: str
    fragment: bool
    nproc: int | None  # run under `lockstep run --nproc-per-node N`

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def snippets(page: Path) -> list[Snippet]:
    """The ```python blocks of a Markdown page, with the marker on the line before each."""
    found, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        fence = lines[i].strip()
        if not fence.startswith("```"):
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"), None)
        assert end is not None, f"{page.name}:{i + 1}: unclosed code block"
        info = fence[3:].strip()
        assert info == "python" or not info.startswith(("py", "ipython")), (
            f"{page.name}:{i + 1}: write ```python (a script that runs) instead of ```{info}"
        )
        if info == "python":
            marker = lines[i - 1].strip() if i > 0 else ""
            launch = LAUNCH.fullmatch(marker)
            assert not marker.startswith("<!--") or marker == FRAGMENT or launch, (
                f"{page.name}:{i}: unknown marker {marker}: use {FRAGMENT} or <!-- launch: N -->"
            )
            code = "\n".join(lines[i + 1 : end]) + "\n"
            found.append(Snippet(page, i + 1, code, marker == FRAGMENT, int(launch[1]) if launch else None))
        i = end + 1
    return found


ALL = [s for page in PAGES for s in snippets(page)]
RUNNABLE = [s for s in ALL if not s.fragment]


def test_there_are_snippets_and_few_fragments():
    assert len(RUNNABLE) >= 20
    assert len(ALL) - len(RUNNABLE) <= len(ALL) // 4, "most snippets must run as shown"


@pytest.mark.parametrize("snippet", ALL, ids=[s.name for s in ALL])
def test_snippet_parses(snippet):
    ast.parse(snippet.code, filename=snippet.name)


def _snippet_marks(snippet: Snippet) -> list[pytest.MarkDecorator]:
    """The README's snippets and each page's first run by default; the others in the slow tier."""
    first = next(s for s in RUNNABLE if s.page == snippet.page)
    return [] if snippet.page.name == "README.md" or snippet is first else [pytest.mark.slow]


@pytest.mark.multirank
@pytest.mark.timeout(SNIPPET_TIMEOUT_S + 30)
@pytest.mark.parametrize("snippet", [pytest.param(s, id=s.name, marks=_snippet_marks(s)) for s in RUNNABLE])
def test_snippet_runs(snippet, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    command = [sys.executable, str(script)]
    if snippet.nproc:
        command = [sys.executable, "-m", "lockstep", "run", "--nproc-per-node", str(snippet.nproc), str(script)]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        command, check=False, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S
    )
    assert done.returncode == 0, (
        f"the snippet at {snippet.name} failed with exit code {done.returncode}:\n"
        f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    )


# --- documented names ---------------------------------------------------------------------

DOTTED = re.compile(r"\blockstep(?:\.[A-Za-z_]\w*)+")


def documented_names() -> list[str]:
    """Every `lockstep.x.y` written inside backticks or code blocks of the docs."""
    names: set[str] = set()
    for page in PAGES:
        text = page.read_text()
        code = re.findall(r"`[^`\n]+`", text) + re.findall(r"```.*?```", text, flags=re.DOTALL)
        for piece in code:
            names.update(m.rstrip(".") for m in DOTTED.findall(piece))
    return sorted(names)


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_documented_names_resolve_after_import_lockstep():
    """In a fresh interpreter, `import lockstep` alone reaches every name the docs write out."""
    names = [n for n in documented_names() if n not in PENDING]
    assert "lockstep.helper.ShardedLoader" in names
    check = (
        "import sys, functools, lockstep\n"
        "bad = []\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        functools.reduce(getattr, name.split('.')[1:], lockstep)\n"
        "    except AttributeError as e:\n"
        "        bad.append(f'{name}: {e}')\n"
        "assert not bad, 'documented but unreachable after import lockstep: ' + '; '.join(bad)\n"
    )
    subprocess.run([sys.executable, "-c", check, *names], check=True, cwd=ROOT, timeout=120)


# --- the front door and CI agree -----------------------------------------------------------

def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    commands = [line.split("#")[0].strip() for line in readme.splitlines() if "python -m pytest" in line]
    assert commands, "the README shows no test command"
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[0] in ci, f"the README's test command {commands[0]!r} is not what .ci/run runs"


def test_readme_is_a_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert re.findall(r"\]\((docs/[^)#]+)", readme), "the README links to no docs page"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces to '-'."""
    prose = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#+ (.+)$", prose, flags=re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_between_pages_resolve():
    for page in PAGES:
        for target, anchor in re.findall(r"\]\(([^)#:\s]*\.md|)(?:#([^)]*))?\)", page.read_text()):
            path = (page.parent / target).resolve() if target else page
            if str(path.relative_to(ROOT)) in PENDING:
                continue
            assert path.is_file(), f"{page.name} links to a missing page: {target}"
            if anchor:
                assert anchor in _anchors(path), f"{page.name} links to a missing anchor: {target}#{anchor}"


# --- the demo's flags ------------------------------------------------------------------------

def test_demo_help_shows_every_flag_with_its_default(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    import train_gpt  # type: ignore[import-not-found]

    parser = train_gpt.build_parser()
    help_text = " ".join(parser.format_help().split())
    page = (ROOT / "docs" / "demo.md").read_text()
    for action in parser._actions:
        if action.dest == "help":
            continue
        flag = action.option_strings[0]
        assert re.search(rf"{flag}\b[^(]*?\(default: ", help_text), f"--help shows no default for {flag}"
        assert f"`{flag}`" in page, f"docs/demo.md does not list {flag}"
