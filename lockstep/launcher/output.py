"""Workers' output on the launcher's console, each line prefixed with the worker's rank.

Workers write to files (torch.distributed.elastic's ``redirects``); a thread in the launcher
follows the files and copies new text to its own stdout/stderr. lockstep does this itself
rather than through torch's ``tee`` because torch's follower reads lines in text mode, which
turns each carriage return of a progress bar into a new line (and a half-written line into two
prefixed halves). Here a ``\\r`` stays a ``\\r``, so rank 0's tqdm bar redraws in place, and a
line cut by another rank's output is finished first and its rest prefixed again.
"""

from __future__ import annotations

import codecs
import glob
import os
import re
import sys
import threading
from collections.abc import Iterable
from typing import BinaryIO, TextIO

from typing_extensions import Self

__all__ = ["RANK_FILE", "OutputRelay", "PrefixWriter"]

# Written by each worker next to its log files, so the relay can name it by global rank.
RANK_FILE = "rank"
_POLL_S = 0.05
_TERMINATORS = re.compile(r"(\r\n|\r|\n)")


class PrefixWriter:
    """Interleave several text streams onto consoles, each line prefixed.

    ``write(source, text, dst)`` may be called with any fragment of a stream; it remembers per
    source whether the next character starts a line.
    """

    def __init__(self) -> None:
        self._at_line_start: dict[str, bool] = {}
        self._open_line: tuple[str, TextIO] | None = None  # a source whose line is unfinished

    def write(self, source: str, prefix: str, text: str, dst: TextIO) -> None:
        """Copy ``text`` from ``source`` to ``dst``, prefixing every line it starts."""
        if self._open_line is not None and self._open_line[0] != source:
            # Another source left a line unfinished: end it here, prefix its rest again.
            self._open_line[1].write("\n")
            self._open_line[1].flush()
            self._at_line_start[self._open_line[0]] = True
            self._open_line = None
        at_start = self._at_line_start.get(source, True)
        out: list[str] = []
        for piece in _TERMINATORS.split(text):
            if not piece:
                continue
            if piece in ("\n", "\r\n"):
                out.append("\n")
                at_start = True
            elif piece == "\r":
                out.append("\r")  # a redraw: the next piece rewrites the same console line
                at_start = True
            else:
                if at_start:
                    out.append(prefix)
                    at_start = False
                out.append(piece)
        self._at_line_start[source] = at_start
        self._open_line = None if at_start else (source, dst)
        dst.write("".join(out))
        dst.flush()


class _Followed:
    """One log file being followed: its open handle, and its partial UTF-8 bytes.

    A worker restarted into a new round of the same attempt (a machine joined or left; the
    restart count does not change) writes a new file under the same path: torch removes the
    attempt's folder and makes it again. The handle held open keeps the old file readable:
    its rest is read first, then the new file (told by its inode) from its start. Until
    2026-11-29 the new file was read from the old one's length on: its first lines were lost.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fh: BinaryIO | None = None
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def read_new(self) -> str:
        text = ""
        if self._fh is not None:
            text = self.decoder.decode(self._fh.read())
            try:
                replaced = os.stat(self.path).st_ino != os.fstat(self._fh.fileno()).st_ino
            except OSError:
                return text  # removed, not made again yet
            if not replaced:
                return text
            self.close()
            text += self.decoder.decode(b"", final=True)
            self.decoder.reset()
        try:
            self._fh = open(self.path, "rb")  # noqa: SIM115 - held across polls, closed by close()
        except OSError:
            return text
        return text + self.decoder.decode(self._fh.read())

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


class OutputRelay:
    """Follow ``<log_dir>/*/attempt_*/<local_rank>/{stdout,stderr}.log`` onto the console.

    Args:
        log_dir: the launch's log folder.
        local_ranks: show only these local ranks (None: all).
        stdout, stderr: where the workers' streams go (the launcher's own by default).

    Example::

        with OutputRelay(log_dir):
            elastic_launch(config, entrypoint)(*args)
    """

    def __init__(
        self,
        log_dir: str,
        local_ranks: Iterable[int] | None = None,
        stdout: TextIO | None = None,
        stderr: TextIO | None = None,
    ) -> None:
        self._log_dir = log_dir
        self._local_ranks = None if local_ranks is None else set(local_ranks)
        self._dst = {"stdout": stdout or sys.stdout, "stderr": stderr or sys.stderr}
        self._files: dict[str, _Followed] = {}
        self._writer = PrefixWriter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lockstep-output", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()  # whatever the workers wrote last
        for followed in self._files.values():
            followed.close()

    def _run(self) -> None:
        while not self._stop.wait(_POLL_S):
            self.poll()

    def _discover(self) -> None:
        pattern = os.path.join(self._log_dir, "*", "attempt_*", "*", "std*.log")
        # Per worker, stdout before stderr: a traceback usually follows what was printed.
        for path in sorted(glob.glob(pattern), key=lambda p: (os.path.dirname(p), "stderr" in p)):
            if path in self._files:
                continue
            local_rank = os.path.basename(os.path.dirname(path))
            if self._local_ranks is None or int(local_rank) in self._local_ranks:
                self._files[path] = _Followed(path)

    def poll(self) -> None:
        """Copy what every followed file gained since the last poll."""
        self._discover()
        for path, followed in self._files.items():
            text = followed.read_new()
            if text:
                stream = os.path.basename(path).split(".")[0]
                self._writer.write(path, _prefix(path), text, self._dst[stream])


def _prefix(log_path: str) -> str:
    """``[rank<global rank>]: ``, from the rank file the worker wrote beside its logs."""
    folder = os.path.dirname(log_path)
    try:
        with open(os.path.join(folder, RANK_FILE)) as fh:
            return f"[rank{int(fh.read())}]: "
    except (OSError, ValueError):
        # Not written (a --no-python program): the local rank is all that is known.
        return f"[local{os.path.basename(folder)}]: "
