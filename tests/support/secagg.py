"""A SecAgg+ round in one process with seeded randomness, and the plain sum to check it by."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from flotilla.core.spec import PrivacySection
from flotilla.secagg import SecAggConfig, SecAggDevice, SecAggServer, Session
from flotilla.secagg.quantize import quantize, weighted


def seeded(label: str) -> Callable[[int], bytes]:
    """Reproducible bytes for tests (a device's randbytes); never for real keys."""
    return random.Random(label).randbytes


@dataclass
class SecAggRound:
    config: SecAggConfig
    session: Session
    identities: dict[str, Ed25519PrivateKey]
    updates: dict[str, np.ndarray]
    weights: dict[str, int]
    devices: dict[str, SecAggDevice]
    server: SecAggServer

    @property
    def device_keys(self) -> dict[str, bytes]:
        return {d: k.public_key().public_bytes_raw() for d, k in self.identities.items()}

    def quantized(self, device: str) -> np.ndarray:
        """The device's w*q || w, recomputed from the same seeded randomness it used."""
        q = quantize(self.updates[device], self.config, seeded(device))
        return weighted(q, self.weights[device], self.config)

    def plain_sum(self, devices: tuple[str, ...]) -> np.ndarray:
        total = np.zeros(self.updates[devices[0]].size + 1, dtype=np.uint64)
        for d in devices:
            total += self.quantized(d)
        return total


def make_round(
    n: int,
    length: int = 64,
    *,
    config: SecAggConfig | None = None,
    job: str = "job-1",
    round: int = 1,
    seed: int = 0,
) -> SecAggRound:
    ids = tuple(f"dev-{i:03d}" for i in range(n))
    session = Session(job, round, ids)
    config = config or SecAggConfig.from_privacy(PrivacySection(secure_aggregation=True), n)
    rng = np.random.default_rng(seed)
    identities = {d: Ed25519PrivateKey.generate() for d in ids}
    updates = {d: (rng.standard_normal(length) * 0.4).astype(np.float32) for d in ids}
    weights = {d: int(rng.integers(1, 500)) for d in ids}
    devices = {
        d: SecAggDevice(config, session, d, identities[d], updates[d], weights[d], seeded(d))
        for d in ids
    }
    keys = {d: k.public_key().public_bytes_raw() for d, k in identities.items()}
    server = SecAggServer(config, session, keys, length=length)
    return SecAggRound(config, session, identities, updates, weights, devices, server)
