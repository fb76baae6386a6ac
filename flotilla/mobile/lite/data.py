"""A device's data as a file: the ``.npz`` that ``flotilla data shard`` writes, read strictly.

Arrays ``x_train``, ``y_train``, ``x_val``, ``y_val`` (inputs with the examples on the
first axis, integer labels), and what made them: ``format``, ``task``, ``shard`` ([i, N]),
``alpha``, ``seed`` and ``data_params`` (JSON). Only plain arrays, read with
``allow_pickle=False``: a data file can hold nothing that runs.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from flotilla.core.errors import SpecError
from flotilla.core.spec import DataSection

FORMAT = "flotilla.shard/1"
ARRAYS = ("x_train", "y_train", "x_val", "y_val")
META = ("format", "task", "shard", "alpha", "seed", "data_params")
#: Largest data file read (a sanity bound against a wrong path, not a budget).
MAX_FILE_BYTES = 1 << 32


@dataclass(frozen=True, slots=True)
class ShardInfo:
    """Where a shard file came from: the task and the data settings that dealt it."""

    task: str
    index: int
    count: int
    alpha: float
    seed: int
    params: Mapping[str, Any]

    def differs_from(self, data: DataSection) -> str | None:
        """Why a job whose ``[data]`` is ``data`` would deal this device another shard."""
        mine = DataSection(self.alpha, self.seed, dict(self.params))
        if mine.key() == data.key():
            return None
        return (
            f"the data file was dealt with alpha={self.alpha}, seed={self.seed}, "
            f"params={dict(self.params)}; the job deals alpha={data.alpha}, seed={data.seed}, "
            f"params={data.params}"
        )


@dataclass(frozen=True, slots=True)
class ShardFile:
    """A device's examples: ``x_*`` float32, ``y_*`` int64, aligned on the first axis."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    info: ShardInfo


def write_shard(path: Path, arrays: Mapping[str, np.ndarray], info: ShardInfo) -> None:
    """Write a shard file (``arrays`` holds :data:`ARRAYS`); checked as :func:`read_shard`
    would, so a file this writes always reads back."""
    shard = _checked({k: np.asarray(arrays[k]) for k in ARRAYS}, info, str(path))
    meta = {
        "format": np.array(FORMAT),
        "task": np.array(info.task),
        "shard": np.array([info.index, info.count], dtype=np.int64),
        "alpha": np.array(info.alpha, dtype=np.float64),
        "seed": np.array(info.seed, dtype=np.int64),
        "data_params": np.array(json.dumps(dict(info.params), sort_keys=True)),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        arrays_out: dict[str, np.ndarray] = {k: getattr(shard, k) for k in ARRAYS}
        np.savez(fh, **arrays_out, **meta)  # type: ignore[arg-type]


def read_shard(path: Path) -> ShardFile:
    """The shard in ``path``; SpecError saying what is wrong with a file that is not one."""
    where = str(path)
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise SpecError(f"{where}: larger than {MAX_FILE_BYTES} bytes")
        with np.load(path, allow_pickle=False) as archive:
            names = set(archive.files)
            missing = sorted(set(ARRAYS + META) - names)
            extra = sorted(names - set(ARRAYS + META))
            if missing or extra:
                raise SpecError(f"{where}: missing arrays {missing}, unexpected arrays {extra}")
            raw = {name: archive[name] for name in ARRAYS + META}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise SpecError(f"{where}: not a shard file (.npz without pickles): {exc}") from exc
    return _checked(raw, _info(raw, where), where)


def _info(raw: Mapping[str, np.ndarray], where: str) -> ShardInfo:
    if str(raw["format"]) != FORMAT:
        raise SpecError(f"{where}: format {str(raw['format'])[:40]!r}, expected {FORMAT!r}")
    shard = raw["shard"]
    if shard.shape != (2,) or shard.dtype.kind not in "iu":
        raise SpecError(f"{where}: shard must be two integers [index, count]")
    try:
        params = json.loads(str(raw["data_params"]))
        alpha, seed = float(raw["alpha"]), int(raw["seed"])
    except (ValueError, TypeError) as exc:
        raise SpecError(f"{where}: malformed alpha, seed or data_params: {exc}") from exc
    if not isinstance(params, dict):
        raise SpecError(f"{where}: data_params must be a JSON object")
    return ShardInfo(str(raw["task"]), int(shard[0]), int(shard[1]), alpha, seed, params)


def _checked(raw: Mapping[str, np.ndarray], info: ShardInfo, where: str) -> ShardFile:
    """The arrays as float32 inputs and int64 labels, after refusing bad shapes and values."""
    out: dict[str, np.ndarray] = {}
    for part in ("train", "val"):
        x, y = raw[f"x_{part}"], raw[f"y_{part}"]
        if x.dtype.kind != "f" or y.dtype.kind not in "iu":
            raise SpecError(
                f"{where}: x_{part} must hold floats and y_{part} integers, "
                f"got {x.dtype} and {y.dtype}"
            )
        if x.ndim < 1 or y.ndim != 1 or x.shape[0] != y.shape[0]:
            raise SpecError(
                f"{where}: x_{part} {list(x.shape)} and y_{part} {list(y.shape)} must hold "
                "the same number of examples (labels one per example)"
            )
        if not np.isfinite(x).all():
            raise SpecError(f"{where}: x_{part} holds NaN or Inf")
        out[f"x_{part}"] = np.ascontiguousarray(x, dtype=np.float32)
        out[f"y_{part}"] = np.ascontiguousarray(y, dtype=np.int64)
    if not len(out["y_train"]):
        raise SpecError(f"{where}: no training examples")
    if out["x_train"].shape[1:] != out["x_val"].shape[1:]:
        raise SpecError(f"{where}: x_train and x_val examples differ in shape")
    return ShardFile(out["x_train"], out["y_train"], out["x_val"], out["y_val"], info)
