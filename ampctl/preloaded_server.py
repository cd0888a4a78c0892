"""What a fork server (preloaded.py) does as it starts, before it imports torch: it asks the kernel to end it when
the command it serves dies.

multiprocessing's server leaves when no process holds the pipe the command holds; but every child it forks is
handed a copy (so that a child could start processes from the same server), so after a `kill -9` of the command the
server, and the children that die with it, would stay. Told by the kernel instead, it goes with the command, and
each child gets its SIGTERM (processes.die_with_parent, the server being its parent). SIGKILL, because the server
keeps the stop signals blocked (preloaded._ensure_server). Imported by the server alone: PRELOAD's first name,
with the command's pid in the environment it starts with; elsewhere, where the environment does not name it,
importing it does nothing.
"""

import signal

from ampctl.processes import FORK_SERVER_PARENT_ENV, die_with_parent

die_with_parent(signal.SIGKILL, FORK_SERVER_PARENT_ENV)
