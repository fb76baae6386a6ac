"""Error feedback: what a lossy codec dropped this round is added back to the next delta.

``target = delta + residual; send C(target); residual = target - decode(C(target))``. Over
rounds the sum of what was sent equals the sum of the deltas minus the last residual, so
nothing is lost for good. Residuals live on the agent, one file per job in its state dir,
and survive restarts.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from flotilla.core.errors import WireError
from flotilla.core.files import write_private_atomic
from flotilla.core.tensors import TensorSpec, decode_state, encode_state, read_metadata

log = logging.getLogger(__name__)

_FORMAT = "flotilla.error-feedback/1"
#: Largest residual file we read back (a sanity bound, not a budget).
MAX_FILE_BYTES = 1 << 36


class ErrorFeedback:
    """Residuals for one job, by tensor name; saved atomically when a directory is given."""

    def __init__(self, job_id: str, directory: Path | None = None) -> None:
        self.job_id = job_id
        self.directory = directory
        self._residuals: dict[str, np.ndarray] = {}

    @property
    def path(self) -> Path | None:
        """``<directory>/ef-<sha256(job id)[:32]>.safetensors``: any job id is a safe name."""
        return None if self.directory is None else state_path(self.directory, self.job_id)

    @classmethod
    def load(
        cls, job_id: str, directory: Path, layout: Iterable[TensorSpec] | None = None
    ) -> ErrorFeedback:
        """The saved residuals for ``job_id`` (none if absent or unreadable, with a warning).

        With ``layout``, residuals for unknown tensors or of the wrong shape are dropped.
        """
        fb = cls(job_id, directory)
        fb._residuals = read_state(state_path(directory, job_id), job_id, layout)
        return fb

    def __len__(self) -> int:
        return len(self._residuals)

    def residual(self, name: str, shape: tuple[int, ...]) -> np.ndarray | None:
        """The residual for ``name``; one of another shape is dropped with a warning."""
        res = self._residuals.get(name)
        if res is not None and res.shape != tuple(shape):
            log.warning(
                "error feedback for job %s: residual %r has shape %s, tensor has %s; dropped",
                self.job_id,
                name,
                res.shape,
                tuple(shape),
            )
            del self._residuals[name]
            return None
        return res

    def compensate(self, name: str, shape: tuple[int, ...], flat: np.ndarray) -> np.ndarray:
        """``delta + residual`` as a new flat float32 array (the delta itself is not touched)."""
        res = self.residual(name, shape)
        if res is None:
            return np.array(flat, dtype=np.float32)
        out: np.ndarray = flat + res.reshape(-1)
        return out

    def update(
        self, name: str, shape: tuple[int, ...], target: np.ndarray, decoded: np.ndarray
    ) -> None:
        """Keep ``target - decoded``: what the receiver will not see this round."""
        self._residuals[name] = (target - decoded.reshape(-1)).reshape(shape)

    def state_dict(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self._residuals.items()}

    def load_state_dict(self, residuals: dict[str, np.ndarray]) -> None:
        self._residuals = {k: np.array(v, dtype=np.float32) for k, v in residuals.items()}

    def save(self) -> None:
        """Write the residuals atomically (temp file, fsync, rename); owner-only permissions."""
        if self.directory is not None:
            write_state(state_path(self.directory, self.job_id), self.job_id, self._residuals)

    def clear(self) -> None:
        """Forget every residual and delete the file (the job ended or its model changed)."""
        self._residuals.clear()
        path = self.path
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def state_path(directory: Path, key: str) -> Path:
    """``<directory>/ef-<sha256(key)[:32]>.safetensors``: any key is a safe file name."""
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    return directory / f"ef-{digest}.safetensors"


def read_state(
    path: Path, key: str, layout: Iterable[TensorSpec] | None = None
) -> dict[str, np.ndarray]:
    """Tensors saved under ``key`` by :func:`write_state`; empty (with a warning) when the
    file is absent, unreadable, corrupt or another key's. Non-finite or non-float32
    tensors, and with ``layout`` unknown or misshapen ones, are dropped."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:
        log.warning("saved state %s: cannot read %s: %s", key, path, exc)
        return {}
    try:
        meta = read_metadata(raw, MAX_FILE_BYTES)
        state = decode_state(raw, None, MAX_FILE_BYTES)
    except WireError as exc:
        log.warning("saved state %s: %s is corrupt (%s); starting afresh", key, path, exc)
        return {}
    if meta.get("format") != _FORMAT or meta.get("job_id") != key:
        log.warning("state file %s is not for job %s; ignored", path, key)
        return {}
    shapes = None if layout is None else {s.name: s.shape for s in layout}
    out: dict[str, np.ndarray] = {}
    for name, arr in state.items():
        if shapes is not None and shapes.get(name) != arr.shape:
            log.warning(
                "saved state %s: dropping residual %r of shape %s (layout says %s)",
                key, name, arr.shape, shapes.get(name),
            )  # fmt: skip
        elif arr.dtype != np.float32 or not np.isfinite(arr).all():
            log.warning(
                "saved state %s: dropping residual %r (%s, non-finite or not float32)",
                key,
                name,
                arr.dtype,
            )
        else:
            out[name] = np.array(arr)
    return out


def write_state(path: Path, key: str, state: Mapping[str, np.ndarray]) -> None:
    """Save ``state`` under ``key`` atomically (temp file, fsync, rename), owner-only."""
    payload = encode_state(dict(state), {"format": _FORMAT, "job_id": key})
    write_private_atomic(path, payload)
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
