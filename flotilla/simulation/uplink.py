"""A simulated device's upload, as a real agent makes it and the server decodes it.

One definition serves the simulator's own process and its training workers: the agent's
:class:`~flotilla.compression.pipeline.UpdatePipeline` (update momentum, the uplink codec
with error feedback), then the server's decode. The codec's randomness for a client's
upload in a round is drawn from a stream keyed by the job's seed, the round and the
client, so a simulation replays however its clients are spread over workers.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from flotilla.compression import CodecContext, decode_state_with, encode_state_with, make_codec
from flotilla.compression.pipeline import UpdatePipeline
from flotilla.core.round_config import RoundConfig
from flotilla.core.tensors import ModelState, TensorSpec, encode_state
from flotilla.simulation.client_state import ClientStateStore


class SimulatedUplink:
    """A simulated device's upload (see the module doc).

    Per-client state (update momentum, error-feedback residuals) is kept per job, in
    memory-mapped stores under ``state_dir`` so 10,000+ clients fit; a job without any
    (:attr:`stateless`) needs no ``state_dir``.
    """

    def __init__(
        self,
        config: RoundConfig,
        layout: tuple[TensorSpec, ...],
        seed: int,
        state_dir: Path | None,
        clients: int,
    ) -> None:
        spec = config.compression
        momentum = config.train.update_momentum
        self._seed = seed
        stateful = spec.error_feedback or momentum > 0
        if stateful and state_dir is None:
            raise ValueError("error feedback and update momentum keep state: give a state_dir")
        self.layout = layout
        self.pipeline: UpdatePipeline[int] = UpdatePipeline(
            make_codec(spec.uplink, spec.uplink_params),
            momentum,
            residuals=(
                ClientStateStore(state_dir / "residuals.f32", clients, layout)
                if spec.error_feedback and state_dir is not None
                else None
            ),
            velocity=(
                ClientStateStore(state_dir / "momentum.f32", clients, layout)
                if momentum > 0 and state_dir is not None
                else None
            ),
        )
        zeros = {s.name: np.zeros(s.shape, np.float32) for s in layout}
        #: An upload's size, known before training: every codec here sends a payload whose
        #: size depends on the layout only (the plain one sends the delta itself).
        self.payload_bytes = len(
            encode_state(zeros)
            if self.pipeline.plain
            else encode_state_with(self.pipeline.codec, zeros, CodecContext.seeded(0))
        )
        #: No per-client state: an update nobody aggregates need not be computed at all,
        #: and any process may make any client's upload.
        self.stateless = self.pipeline.residuals is None and self.pipeline.velocity is None

    @staticmethod
    def context(seed: int, round_no: int, client: int) -> CodecContext:
        """The codec randomness of ``client``'s upload in round ``round_no``."""
        return CodecContext(np.random.default_rng([seed % 2**32, 3, round_no, client]))

    def __call__(self, client: int, delta: ModelState, round_no: int) -> tuple[ModelState, int]:
        """The delta as the server decodes it, and the bytes it took on the uplink."""
        pipeline = self.pipeline
        delta = pipeline.smooth(client, delta)
        if pipeline.plain:  # the payload is the delta itself: skip encoding and decoding
            return delta, self.payload_bytes
        payload = pipeline.encode(client, delta, self.context(self._seed, round_no, client))
        decoded = decode_state_with(payload, self.layout, len(payload), codec=pipeline.codec)
        return decoded, len(payload)
