"""ExecuTorch, imported only where it is used: the pinned version, the install hint, and an
import that keeps ExecuTorch's import-time chatter out of a user's terminal.

Imports neither at module level, so a command can say "install the ``mobile-export``
extra" on an install that has neither torch nor ExecuTorch. The lite client's one door to
ExecuTorch (``flotilla-lite --program``) is this module.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from flotilla.core.errors import SpecError

#: The ExecuTorch release the ``mobile-export`` extra pins and the tests train with.
EXECUTORCH_VERSION = "1.5.1"
INSTALL_HINT = "pip install 'flotilla[mobile-export]'"
#: Loggers that warn at ExecuTorch's import about GPU kernels (torchao) and deprecated
#: pytree calls: nothing someone exporting or training a model can act on.
_NOISY = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_import() -> Iterator[None]:
    """Hold ExecuTorch's noisy import-time loggers to errors."""
    saved = [(logging.getLogger(name), logging.getLogger(name).level) for name in _NOISY]
    for logger, _ in saved:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in saved:
            logger.setLevel(level)


def training_runtime(purpose: str) -> Any:
    """``executorch.extension.training``, or a SpecError that says how to install it."""
    try:
        with quiet_import():
            import executorch.extension.training as training
    except ImportError as exc:
        raise SpecError(
            f"{purpose} needs ExecuTorch (executorch=={EXECUTORCH_VERSION}): {INSTALL_HINT} ({exc})"
        ) from exc
    return training


def load_training_module(program: bytes, purpose: str) -> Any:
    """ExecuTorch's (experimental) ``TrainingModule`` of a ``.pte``; SpecError if ExecuTorch
    is missing or cannot load it."""
    runtime = training_runtime(purpose)
    with warnings.catch_warnings():  # "experimental": the docs say so once, not every run
        warnings.filterwarnings("ignore", "This API is experimental")
        try:
            return runtime._load_for_executorch_for_training_from_buffer(program)
        except RuntimeError as exc:
            raise SpecError(f"{purpose}: ExecuTorch cannot load the program: {exc}") from exc


def as_inputs(arrays: Sequence[np.ndarray]) -> tuple[Any, ...]:
    """NumPy batches as the tensors ExecuTorch's Python runtime takes (sharing memory)."""
    import torch

    return tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays)
