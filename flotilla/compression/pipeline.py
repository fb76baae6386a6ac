"""The device-side update pipeline: update momentum, then the uplink codec with error feedback.

One implementation for the agent and for simulated devices, so a simulated device sends
exactly the bytes a real one would. What differs between them is injected:

- where per-client state lives (a :class:`StateStore`): in memory, in files in the agent's
  state dir (:class:`FileStates`, surviving restarts), or one memory-mapped file for a
  simulated population of 10,000+ clients;
- where the codec's randomness comes from (an :data:`Entropy`): fresh OS entropy on a
  device, so stochastic codecs round independently everywhere; a seeded stream in the
  simulator, so runs replay.

Momentum (``m = beta*m + (1-beta)*delta``) and error-feedback residuals are separate
stores: each is a model's worth of float32 per client, kept across rounds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Generic, Protocol, TypeVar

import numpy as np

from flotilla.compression.codec import Codec, CodecContext
from flotilla.compression.feedback import ErrorFeedback, read_state, state_path, write_state
from flotilla.compression.state import encode_state_with
from flotilla.core.tensors import ModelState, encode_state

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)
K_contra = TypeVar("K_contra", bound=Hashable, contravariant=True)

#: Makes the codec context for one encoding (the codec's randomness).
Entropy = Callable[[], CodecContext]


class StateStore(Protocol[K_contra]):
    """Per-client tensors kept from one round to the next."""

    def get(self, client: K_contra) -> ModelState | None:
        """The client's tensors (read-only; valid until its next ``put``), or None."""
        ...

    def put(self, client: K_contra, state: ModelState) -> None: ...


class MemoryStates(Generic[K]):
    """States in a dict: an agent without a state dir, and tests."""

    def __init__(self) -> None:
        self._states: dict[K, ModelState] = {}

    def get(self, client: K) -> ModelState | None:
        return self._states.get(client)

    def put(self, client: K, state: ModelState) -> None:
        self._states[client] = dict(state)


class FileStates:
    """One safetensors file per key (a job id) in the agent's state dir, kept in memory too.

    ``prefix`` names the kind of state in the file's key (residuals use none, momentum
    ``"momentum:"``), so files written by earlier releases are read back unchanged.
    """

    def __init__(self, directory: Path, prefix: str = "") -> None:
        self.directory = directory
        self.prefix = prefix
        self._cache: dict[str, ModelState] = {}

    def get(self, client: str) -> ModelState | None:
        if client not in self._cache:
            key = self.prefix + client
            self._cache[client] = read_state(state_path(self.directory, key), key)
        return self._cache[client] or None

    def put(self, client: str, state: ModelState) -> None:
        key = self.prefix + client
        write_state(state_path(self.directory, key), key, state)
        self._cache[client] = dict(state)


class UpdatePipeline(Generic[K]):
    """Momentum, codec and error feedback for one job, over any number of clients."""

    def __init__(
        self,
        codec: Codec,
        momentum: float = 0.0,
        *,
        residuals: StateStore[K] | None = None,
        velocity: StateStore[K] | None = None,
        entropy: Entropy = CodecContext,
    ) -> None:
        self.codec = codec
        self.momentum = momentum
        #: Error-feedback residuals; None sends without error feedback.
        self.residuals = residuals
        #: Update momentum; unused (and may be None) when ``momentum`` is 0.
        self.velocity = velocity if momentum > 0 else None
        self.entropy = entropy

    @property
    def plain(self) -> bool:
        """True when the codec is ``none``: the payload is plain safetensors of the delta."""
        return self.codec.name == "none"

    def smooth(self, client: K, delta: ModelState) -> ModelState:
        """Update momentum: ``m = beta*m + (1-beta)*delta``, kept per client across rounds."""
        if self.velocity is None:
            return delta
        beta = self.momentum
        previous = _matching(self.velocity.get(client), delta, client)
        out: ModelState = {}
        for name, value in delta.items():
            held = previous.get(name)
            m = (1.0 - beta) * value if held is None else beta * held + (1 - beta) * value
            out[name] = np.asarray(m, dtype=np.float32)
        self.velocity.put(client, out)
        return out

    def encode(self, client: K, delta: ModelState, context: CodecContext | None = None) -> bytes:
        """The upload: plain safetensors for ``none``, else the codec's payload, with the
        client's residual added first and what the codec dropped kept for next round.
        The codec draws from ``context`` when given, else from :attr:`entropy`."""
        if self.plain:
            return encode_state(delta)  # what every client can send
        feedback = None
        if self.residuals is not None:
            feedback = ErrorFeedback(str(client))
            feedback.load_state_dict(_matching(self.residuals.get(client), delta, client))
        context = context if context is not None else self.entropy()
        payload = encode_state_with(self.codec, delta, context, feedback)
        if feedback is not None and self.residuals is not None:
            self.residuals.put(client, feedback.state_dict())
        return payload

    def __call__(self, client: K, delta: ModelState) -> bytes:
        """Smooth, then encode: the bytes a device uploads for ``delta``."""
        return self.encode(client, self.smooth(client, delta))


def _matching(held: ModelState | None, like: ModelState, client: object) -> ModelState:
    """The held tensors that still fit ``like``'s layout; one of another shape is dropped."""
    if held is None:
        return {}
    out: ModelState = {}
    for name, value in like.items():
        arr = held.get(name)
        if arr is None:
            continue
        if arr.shape != np.shape(value):
            log.warning(
                "saved state of client %s: %r has shape %s, tensor has %s; dropped",
                client, name, arr.shape, np.shape(value),
            )  # fmt: skip
            continue
        out[name] = arr
    return out
