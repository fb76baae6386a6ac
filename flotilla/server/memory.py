"""Giving freed heap memory back to the operating system.

Model-sized transfers pass through gRPC and protobuf as many 1 MiB buffers; glibc keeps
what they free in its arenas, so a long-running server's RSS creeps up round after round
although nothing is in use. ``malloc_trim`` returns those pages. Elsewhere (macOS, musl)
this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable


def _trimmer() -> Callable[[], None]:
    if not sys.platform.startswith("linux"):
        return lambda: None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int

    def release() -> None:
        trim(0)

    return release


#: Return free heap pages to the OS (cheap: a few milliseconds on a large heap).
release_free_memory = _trimmer()
