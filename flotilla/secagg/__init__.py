"""Secure aggregation (SecAgg+, Bell et al. CCS 2020): the server learns the weighted sum
of a round's updates and nothing about any single one. numpy and ``cryptography`` only.

- ``config``: :class:`SecAggConfig` (k, t, clip, bits, modulus), :class:`Stage`,
  :class:`Session` (job, round, participants).
- ``graph``: the shuffled ring (Harary graph) and each device's k neighbours.
- ``shamir``: Shamir sharing over the prime 2**521 - 1.
- ``keys``: X25519 key pairs, HKDF-derived mask seeds and share keys, ChaCha20-Poly1305
  share encryption, the Ed25519-signed statements.
- ``prg``: ChaCha20 expansion of a seed into masks mod 2**m.
- ``quantize``: clipping, stochastic rounding, the weight, and the exact way back.
- ``bits``: m-bit packing of masked inputs.
- ``messages``: the strict, versioned binary formats of every stage's messages.
- ``device``: :class:`SecAggDevice`; ``server``: :class:`SecAggServer`;
  ``result``: :class:`MaskedSum`; ``drive``: :func:`run_in_process`.
- ``errors``: :class:`SecAggError` and its three kinds, each with a ``reason``.

See docs/secure-aggregation.md.
"""

from flotilla.secagg.config import SecAggConfig, Session, Stage, auto_neighbours, auto_threshold
from flotilla.secagg.device import SecAggDevice
from flotilla.secagg.drive import run_in_process
from flotilla.secagg.errors import SecAggAborted, SecAggError, SecAggMessageError, SecAggRefused
from flotilla.secagg.quantize import dequantize_sum, quantize
from flotilla.secagg.result import MaskedSum
from flotilla.secagg.server import SecAggServer

__all__ = [
    "MaskedSum",
    "SecAggAborted",
    "SecAggConfig",
    "SecAggDevice",
    "SecAggError",
    "SecAggMessageError",
    "SecAggRefused",
    "SecAggServer",
    "Session",
    "Stage",
    "auto_neighbours",
    "auto_threshold",
    "dequantize_sum",
    "quantize",
    "run_in_process",
]
