"""preloaded.py: a child forked from the preloaded server is the process its command line would exec: its
argv, environment, working directory (and sys.path[0]), standard streams, a session of its own, the stop signals
at their defaults and unblocked, atexit handlers at its end, its interpreter's exit status (an exit code, a
SystemExit message, an exception, an uncaught Ctrl-C), a descriptor named in its environment; and a stop signal
sent to the server (as to the command's whole process group) does not end it. That a child is stopped when the
command is killed with SIGKILL is tests/adversarial/test_signals.py's, with a real comparison."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ampctl.preloaded import PreloadedProcess

SCRIPT = r"""
import atexit, json, os, signal, sys
atexit.register(lambda: print("atexit ran", flush=True))
what = sys.argv[1]
if what == "describe":
    stops = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "env": os.environ.get("ONLY_HERE"),
                      "own_session": os.getsid(0) == os.getpid(),
                      "defaults": [signal.getsignal(s) == signal.SIG_DFL for s in stops]
                                  + [signal.getsignal(signal.SIGINT) is signal.default_int_handler],
                      "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
                      "stdin": sys.stdin.readline()}))
    print("to stderr", file=sys.stderr)
    os.write(int(os.environ["THE_FD"]), b"through the fd\n")
elif what == "wait":
    sys.stdin.readline()
elif what == "exit":
    sys.exit(int(sys.argv[2]))
elif what == "message":
    sys.exit("a message")
elif what == "raise":
    raise RuntimeError("boom")
elif what == "ctrl-c":
    raise KeyboardInterrupt
"""


def start(tmp_path: Path, *args: str, **streams) -> tuple[PreloadedProcess, Path, Path]:
    script = tmp_path / "child.py"
    script.write_text(SCRIPT)
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = PreloadedProcess([sys.executable, str(script), *args], env={**os.environ, "ONLY_HERE": "yes"},
                                   stdout=stdout.fileno(), stderr=stderr.fileno(), **streams)
    return process, out, err


def test_a_child_is_the_process_its_command_line_would_exec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    stdin_read, stdin_write = os.pipe()
    fd_read, fd_write = os.pipe()
    os.write(stdin_write, b"hello\n")
    os.close(stdin_write)
    process, out, err = start(tmp_path, "describe", stdin=stdin_read, fds_in_env={"THE_FD": fd_write})
    os.close(stdin_read)
    os.close(fd_write)
    assert process.wait(timeout=120) == 0, err.read_text()
    described, atexit_line = out.read_text().splitlines()
    described = json.loads(described)
    assert described["argv"] == [str(tmp_path / "child.py"), "describe"]
    assert described["cwd"] == described["path0"] == str(tmp_path)
    assert described["env"] == "yes" and described["stdin"] == "hello\n" and described["own_session"]
    assert all(described["defaults"]) and described["blocked"] == []
    assert err.read_text() == "to stderr\n" and atexit_line == "atexit ran"
    assert os.read(fd_read, 100) == b"through the fd\n"
    os.close(fd_read)


def test_a_childs_collections_leave_out_what_the_server_imported(tmp_path):
    """torch and ampctl, imported by the server, are frozen in each child (gc.freeze): its collections, and its
    run's gc.collect() before a memory measurement, scan only what the child makes."""
    script = tmp_path / "collects.py"
    script.write_text("import gc, sys\nprint('torch' in sys.modules, gc.get_freeze_count(), gc.isenabled())\n")
    out = tmp_path / "out.txt"
    with out.open("w") as stdout:
        process = PreloadedProcess([sys.executable, str(script)], env=dict(os.environ), stdout=stdout.fileno())
    assert process.wait(timeout=120) == 0
    torch_imported, frozen, collecting = out.read_text().split()
    assert torch_imported == "True" and int(frozen) > 100_000 and collecting == "True"


def test_a_child_imports_from_the_pythonpath_it_was_given(tmp_path):
    """The server's sys.path is that of the process that started it; a child given another PYTHONPATH (a test's
    recipe module, a user's) finds its modules there, after its script's directory, as its interpreter would."""
    lib, elsewhere = tmp_path / "lib", tmp_path / "elsewhere"
    lib.mkdir()
    elsewhere.mkdir()
    (lib / "only_on_its_pythonpath.py").write_text("WHERE = 'lib'\n")
    script = tmp_path / "scripts" / "imports.py"
    script.parent.mkdir()
    script.write_text("import sys, only_on_its_pythonpath\nprint(only_on_its_pythonpath.WHERE, sys.path[:2])\n")
    out, err = tmp_path / "out.txt", tmp_path / "err.txt"
    with out.open("w") as stdout, err.open("w") as stderr:
        process = PreloadedProcess([sys.executable, str(script)], env={**os.environ, "PYTHONPATH": str(lib)},
                                   stdout=stdout.fileno(), stderr=stderr.fileno(), cwd=elsewhere)
    assert process.wait(timeout=120) == 0, err.read_text()
    assert out.read_text() == f"lib {[str(script.parent), str(lib)]}\n"


@pytest.mark.parametrize("args,status,stderr", [(("exit", "3"), 3, ""), (("message",), 1, "a message\n"),
                                                (("raise",), 1, "RuntimeError: boom"),
                                                (("ctrl-c",), -signal.SIGINT, "KeyboardInterrupt")])
def test_a_child_ends_with_its_interpreters_exit_status_after_its_atexit_handlers(tmp_path, args, status, stderr):
    process, out, err = start(tmp_path, *args)
    assert process.wait(timeout=120) == status == process.returncode == process.poll()
    assert stderr in err.read_text() and ("Traceback" in err.read_text()) == (args[0] in ("raise", "ctrl-c"))
    assert out.read_text() == "atexit ran\n"


def test_a_module_runs_as_python_m_runs_it(tmp_path):
    out = tmp_path / "out.txt"
    with out.open("w") as stdout:
        process = PreloadedProcess([sys.executable, "-m", "ampctl", "--version"], env=dict(os.environ),
                                   stdout=stdout.fileno())
    assert process.wait(timeout=120) == 0 and out.read_text().startswith("ampctl ")
    with pytest.raises(ValueError, match="not a `python -m MODULE` or `python SCRIPT` command"):
        PreloadedProcess([sys.executable, "-c", "pass"], env={})


def test_a_stop_signal_to_the_whole_process_group_leaves_the_server_serving(tmp_path):
    stdin_read, stdin_write = os.pipe()
    waiting, _, _ = start(tmp_path, "wait", stdin=stdin_read)
    os.close(stdin_read)
    server = _parent_of(waiting.pid)
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        os.kill(server, signum)
    os.close(stdin_write)
    assert waiting.wait(timeout=120) == 0
    second, _, _ = start(tmp_path, "exit", "5")
    assert second.wait(timeout=120) == 5


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_descriptors_the_server_received_as_0_1_or_2_are_lifted_before_the_standard_streams_are_set():
    """The server closed its stdin, and the command that started it may have had any of its standard streams
    closed: it receives a child's descriptors as the lowest free numbers. Each is moved above 2 (the same file)."""
    from ampctl.preloaded import _above_standard_streams

    read, write = os.pipe()
    saved = os.dup(0)
    try:
        os.dup2(read, 0)
        lifted = _above_standard_streams(0)
        assert lifted > 2 and os.fstat(lifted).st_ino == os.fstat(read).st_ino
        assert _above_standard_streams(write) == write  # above 2 already: itself
        os.close(lifted)
    finally:
        os.dup2(saved, 0)
        for fd in (saved, read, write):
            os.close(fd)


def test_a_child_with_a_thread_pool_ends_as_python_ends_it(tmp_path):
    """concurrent.futures' worker threads are non-daemon and end on threading's own exit hook (Inductor's compile
    pool is one): a child that joined its threads before that hook waited for them forever."""
    script = tmp_path / "pool.py"
    script.write_text("from concurrent.futures import ThreadPoolExecutor\n"
                      "import sys\nsys.pool = ThreadPoolExecutor(2)  # kept, as Inductor keeps its compile pool\n"
                      "print(sys.pool.submit(lambda: 6 * 7).result())\n")
    out = tmp_path / "out.txt"
    with out.open("w") as stdout:
        process = PreloadedProcess([sys.executable, str(script)], env=dict(os.environ), stdout=stdout.fileno())
    assert process.wait(timeout=60) == 0 and out.read_text() == "42\n"


def test_an_unguarded_script_that_starts_a_child_is_not_run_again_in_it(tmp_path):
    """multiprocessing would run the parent's __main__ script again in the child: a script calling ampctl.compare
    at its top level would compare again in every mode."""
    parent = tmp_path / "parent.py"
    parent.write_text("import os, sys\n"
                      "from ampctl.preloaded import PreloadedProcess\n"
                      f"open({str(tmp_path / 'ran')!r}, 'a').write('parent ran\\n')\n"
                      "child = PreloadedProcess([sys.executable, '-m', 'ampctl', '--version'], env=dict(os.environ))\n"
                      "print(child.wait(60))\n")
    done = subprocess.run([sys.executable, str(parent)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "0", done.stderr[-2000:]
    assert (tmp_path / "ran").read_text() == "parent ran\n"


def test_a_command_killed_with_sigkill_takes_the_server_and_its_children_with_it(tmp_path):
    """Every child holds a copy of the pipe whose end would tell multiprocessing's server that the command is gone;
    the kernel tells it instead (preloaded_server.py), and each child is told when the server goes. A command that
    started a child with child_environment(), then killed with SIGKILL: the server and the child end."""
    command = tmp_path / "command.py"
    command.write_text("import sys, time\n"
                       "from ampctl.preloaded import PreloadedProcess\n"
                       "from ampctl.processes import child_environment\n"
                       f"child = PreloadedProcess([sys.executable, {str(tmp_path / 'child.py')!r}], "
                       "env=child_environment())\n"
                       "print(child.pid, flush=True)\n"
                       "time.sleep(600)\n")
    (tmp_path / "child.py").write_text("from ampctl.processes import die_with_parent\nimport time\n"
                                       "die_with_parent()\nprint('child up', flush=True)\ntime.sleep(600)\n")
    started = subprocess.Popen([sys.executable, str(command)], stdout=subprocess.PIPE, text=True)
    # the child's line and the command's share the pipe, in either order (seen in CI: 'child up' first); the
    # child's says it asked to die with its parent, so the kill below cannot come before it
    said = sorted(started.stdout.readline().strip() for _ in range(2))
    assert said[1] == "child up", said
    child = int(said[0])
    server = _parent_of(child)
    assert server != started.pid and _parent_of(server) == started.pid
    started.kill()
    started.wait()
    for pid in (server, child):
        _wait_until_gone(pid)


def _wait_until_gone(pid: int, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        stat = Path(f"/proc/{pid}/stat").read_text() if Path(f"/proc/{pid}").exists() else ""
        if stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]:  # ended, not yet reaped by its new parent
            return
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists(), f"pid {pid} still runs"
