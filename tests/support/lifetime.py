"""Every process a test starts dies with the test run, even when pytest is killed with -9.

Start commands as ``bound(argv)``: ``setpriv --pdeathsig KILL`` (util-linux) asks the
kernel to SIGKILL the command when the process that started it exits, however it exits,
and then execs the command in place (same pid). A ``preexec_fn`` would do the same in
Python, but it forces ``fork()`` instead of ``vfork()``, and grpc's fork handlers can
abort such a child when the test process has grpc threads (seen: "epoll_wait error: Bad
file descriptor", exit -6).
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence

#: The prefix that binds a command's life to its parent's (setpriv found once, here, so a
#: command run with an empty PATH still starts).
DIE_WITH_PARENT = (shutil.which("setpriv") or "/usr/bin/setpriv", "--pdeathsig", "KILL", "--")


def bound(argv: Sequence[str]) -> list[str]:
    """``argv`` run so that it dies with the process that starts it."""
    return [*DIE_WITH_PARENT, *argv]
