"""HTTP devices for tests: the protocol's Python client (``flotilla.mobile.lite.http``) run
off the test's event loop (which serves the server), plus updates made with NumPy."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
from safetensors.numpy import load as load_safetensors
from safetensors.numpy import save as save_safetensors

from flotilla.core.device import DeviceProfile
from flotilla.core.timeouts import Timeouts
from flotilla.mobile.lite.http import HttpDevice, OfferedTask
from tests.support.inproc import DIGITS

T = TypeVar("T")
#: Short waits: a test fails in seconds, not minutes, when something hangs.
DEVICE_TIMEOUTS = Timeouts(poll_s=15.0, transfer_s=60.0, upload_idle_s=10.0)


async def off_loop(call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    return await asyncio.to_thread(call, *args, **kwargs)


async def enrolled(base: str, token: str, **options: Any) -> HttpDevice:
    device = HttpDevice(base, timeouts=DEVICE_TIMEOUTS, **options)
    await off_loop(device.enrol, token, DeviceProfile("", tasks=(DIGITS,), gflops=1.0))
    return device


async def task_of(device: HttpDevice, job_id: str, timeout_s: float = 30.0) -> OfferedTask:
    """Poll, as an idle device does, until a round of ``job_id`` is offered."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        task = await off_loop(device.poll)
        if task is not None and task.order.job_id == job_id:
            return task
    raise AssertionError(f"no round of {job_id} was offered within {timeout_s}s")


def small_update(model: bytes, value: float = 1e-3) -> bytes:
    """A well-formed delta for ``model`` (safetensors bytes): every tensor, small values."""
    state = load_safetensors(model)
    return bytes(save_safetensors({k: np.full(v.shape, value, v.dtype) for k, v in state.items()}))


def model_bytes(path: Path) -> bytes:
    return path.read_bytes()
