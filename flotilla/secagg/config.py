"""SecAgg+ settings, the protocol's stages and one round's session (who takes part)."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from flotilla.core.errors import ConfigError
from flotilla.core.spec import PrivacySection

#: The longest update a round may mask (elements, the appended weight not counted).
MAX_LENGTH = 1 << 28
#: The most devices one SecAgg+ round may hold.
MAX_DEVICES = 10_000


class Stage(enum.IntEnum):
    """The device's replies, in order; the server's message for a stage comes before it."""

    ADVERTISE = 1  # device -> server: signed X25519 public keys (c_pk shares, s_pk masks)
    SHARE = 2  # device -> server: AEAD-encrypted Shamir shares of b_i and s_sk_i
    MASKED_INPUT = 3  # device -> server: w*q || w + PRG(b_i) + sum_j +-PRG(s_ij) mod 2**m
    CONSISTENCY = 4  # device -> server: its signature over (job, round, U3)
    UNMASK = 5  # device -> server: shares of b_j for survivors, of s_sk_j for dropouts


@dataclass(frozen=True, slots=True)
class Session:
    """One round: the ring is a shuffle of ``participants`` seeded from (job, round), so
    every party computes the same neighbourhoods without being told them."""

    job_id: str
    round: int
    participants: tuple[str, ...]

    def __post_init__(self) -> None:
        if not self.job_id or self.round < 0:
            raise ConfigError("secagg session: job_id must be set and round >= 0")
        if len(set(self.participants)) != len(self.participants):
            raise ConfigError("secagg session: participants must be distinct")
        if not 2 <= len(self.participants) <= MAX_DEVICES:
            raise ConfigError(
                f"secagg session: {len(self.participants)} participants; "
                f"secure aggregation needs 2 to {MAX_DEVICES}"
            )
        if any(not p or len(p.encode()) > 128 for p in self.participants):
            raise ConfigError("secagg session: device ids must be 1 to 128 bytes")


def auto_neighbours(devices: int) -> int:
    """k = 2*ceil(log2 n), even, or n - 1 (everyone) when that is no larger."""
    k = 2 * math.ceil(math.log2(max(devices, 2)))
    return min(k, devices - 1)


def auto_threshold(neighbours: int) -> int:
    """t = a strict majority of the k neighbours (the device holds no share of its own)."""
    return neighbours // 2 + 1


@dataclass(frozen=True, slots=True)
class SecAggConfig:
    """``threshold`` counts neighbours' shares only: a device keeps none of its own."""

    neighbours: int
    threshold: int
    clip: float
    quantization_bits: int
    modulus_bits: int
    stage_timeout_s: float
    max_weight: int = 2**20

    def __post_init__(self) -> None:
        if not 1 <= self.threshold <= self.neighbours:
            raise ConfigError(
                f"secagg: need 1 <= threshold <= neighbours, got t={self.threshold}, "
                f"k={self.neighbours}"
            )
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise ConfigError(f"secagg: clip must be finite and > 0, got {self.clip!r}")
        if not 1 <= self.quantization_bits < self.modulus_bits <= 64:
            raise ConfigError(
                "secagg: need 1 <= quantization_bits < modulus_bits <= 64, got "
                f"b={self.quantization_bits}, m={self.modulus_bits}"
            )
        if not (math.isfinite(self.stage_timeout_s) and self.stage_timeout_s > 0):
            raise ConfigError("secagg: stage_timeout_s must be > 0")
        if not 1 <= self.max_weight < 2**40:
            raise ConfigError(f"secagg: max_weight must be in [1, 2**40), got {self.max_weight}")

    def check_devices(self, devices: int) -> None:
        """The ring and the modulus hold ``devices`` devices (ConfigError says what not)."""
        if not 2 <= devices <= MAX_DEVICES:
            raise ConfigError(f"secagg: {devices} devices; need 2 to {MAX_DEVICES}")
        k = self.neighbours
        if k > devices - 1:
            raise ConfigError(f"secagg: {k} neighbours but only {devices - 1} other devices")
        if k < devices - 1 and k % 2:
            raise ConfigError(f"secagg: neighbours must be even (k/2 each side), got {k}")
        largest = devices * self.max_weight * (2**self.quantization_bits - 1)
        if largest >= 2**self.modulus_bits:
            need = largest.bit_length()
            raise ConfigError(
                f"secagg: the weighted sum of {devices} devices may reach 2**{need - 1} and "
                f"overflow modulus_bits={self.modulus_bits}; raise it to {need} or lower "
                "quantization_bits or max_weight"
            )

    def check(self, devices: int, length: int) -> None:
        """Refuse, before any work, settings that cannot hold this round's sum."""
        self.check_devices(devices)
        if not 1 <= length <= MAX_LENGTH:
            raise ConfigError(f"secagg: update length {length} not in [1, {MAX_LENGTH}]")

    @classmethod
    def from_privacy(cls, section: PrivacySection, devices: int) -> SecAggConfig:
        """The job's ``[privacy]`` for a round of ``devices``: 0 neighbours or threshold
        mean automatic (:func:`auto_neighbours`, :func:`auto_threshold`)."""
        if devices < 2:
            raise ConfigError(f"secagg: {devices} devices; secure aggregation needs 2 or more")
        k = section.neighbours or auto_neighbours(devices)
        config = cls(
            neighbours=k,
            threshold=section.threshold or auto_threshold(k),
            clip=section.clip,
            quantization_bits=section.quantization_bits,
            modulus_bits=section.modulus_bits,
            stage_timeout_s=section.stage_timeout_s,
        )
        config.check_devices(devices)
        return config

    def words(self, length: int) -> int:
        """Elements a masked input carries: the update and its weight."""
        return length + 1
