"""A command run in a pseudo-terminal of a given width, as a user's terminal shows it: what it printed, line by line
(the terminal's own wrapping is the test's to see: a line longer than the width is one the terminal would break
wherever its last column falls)."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from tests.support.runs import REPO

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def in_a_terminal(args: list[str], cwd: Path, columns: int = 80, timeout: float = 240.0) -> tuple[int, list[str]]:
    """`python -m ampctl ARGS` with stdout and stderr on a terminal `columns` wide: (exit code, its lines, colours
    and cursor moves taken out)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": str(columns), "TERM": "xterm"}
    env.pop("CI", None)  # rich treats CI as a terminal-less log
    process = subprocess.Popen([sys.executable, "-m", "ampctl", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                               stdout=follower, stderr=follower, start_new_session=True)
    os.close(follower)
    chunks, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 0.5)
        if ready:
            try:
                data = os.read(leader, 65536)
            except OSError:  # the other end closed
                break
            if not data:
                break
            chunks.append(data)
        elif process.poll() is not None:
            break
    os.close(leader)
    code = process.wait(timeout=30)
    text = _ANSI.sub("", b"".join(chunks).decode(errors="replace")).replace("\r\n", "\n").replace("\r", "\n")
    return code, text.split("\n")


def cut_mid_word(lines: list[str], columns: int) -> list[str]:
    """The lines the terminal would break inside a word: longer than its width, with a space before the last column
    where they could have been broken (a single word longer than the width cannot be; a command to copy must not be,
    io.is_command)."""
    from ampctl.io import is_command

    return [line for line in lines if len(line) > columns and " " in line[:columns].strip() and not is_command(line)]
