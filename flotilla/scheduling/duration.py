"""Predicted round time of a device for a job, with its uncertainty.

A device never seen on a job is predicted from its profile: its measured speed, upload
rate and the samples it holds for the job's task, scaled by what the job's other devices
took (compute x GFLOP/s per sample and transfer x bytes/s are roughly constant across
devices for one job). Its own rounds then take over, weighted
by how many there are and how much they varied. Everything is in log seconds, where a
fleet's speeds are roughly normal, and vectorized over the candidates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from flotilla.core.device import DeviceProfile
from flotilla.scheduling.history import FleetHistory

#: Log-space spread of a prediction made from the profile alone, and the floor of a
#: device's own spread (round times are never perfectly repeatable).
PRIOR_LOG_STD = 1.0
MIN_LOG_STD = 0.15


@dataclass(frozen=True, slots=True)
class Prediction:
    """Per candidate, in the order asked: log-normal round time and failure odds."""

    log_mean: np.ndarray
    log_std: np.ndarray
    #: Posterior mean probability that the device fails to deliver (Beta(1, 4) prior).
    p_fail: np.ndarray

    def seconds(self, z: float = 0.0) -> np.ndarray:
        """Round time at ``z`` standard deviations above the median (z = 1.28: p90)."""
        return np.exp(self.log_mean + z * self.log_std)


@dataclass(slots=True)
class DurationModel:
    history: FleetHistory
    #: The profile of a device the history mentions (None once it is gone).
    profile_of: Callable[[str], DeviceProfile | None]
    #: Guess for a job nobody has delivered on yet (seconds, for the median device).
    default_s: float = 10.0
    #: The job's task: devices report their samples per task.
    task: str = ""

    def samples(self, job_id: str, candidates: Sequence[DeviceProfile]) -> np.ndarray:
        """Training samples each candidate holds for the task: what its profile says, else
        what it last trained on for this job; 0 where neither is known."""
        records = self.history.job(job_id)
        out = np.zeros(len(candidates))
        for i, c in enumerate(candidates):
            told = c.samples.get(self.task, 0)
            rec = records.get(c.device_id)
            out[i] = told if told > 0 else (rec.last_samples if rec is not None else 0)
        return out

    def filled_samples(self, job_id: str, candidates: Sequence[DeviceProfile]) -> np.ndarray:
        """:meth:`samples` with the unknown ones counted as the typical device's (the
        median of the known), and 1 for every device when none is known."""
        return _fill_unmeasured(self.samples(job_id, candidates))

    def predict(self, job_id: str, candidates: Sequence[DeviceProfile]) -> Prediction:
        records = self.history.job(job_id)
        gflops = np.array([max(c.gflops, 0.0) for c in candidates], dtype=np.float64)
        upload = np.array([max(c.upload_bytes_per_s, 0.0) for c in candidates], dtype=np.float64)
        prior = np.log(
            self._prior_seconds(job_id, gflops, upload, self.samples(job_id, candidates))
        )
        n = np.zeros(len(candidates))
        own_mean = np.zeros(len(candidates))
        own_var = np.full(len(candidates), MIN_LOG_STD**2)
        fails = np.zeros(len(candidates))
        picks = np.zeros(len(candidates))
        for i, c in enumerate(candidates):
            rec = records.get(c.device_id)
            if rec is None:
                continue
            fails[i], picks[i] = rec.failures, rec.selected
            if rec.delivered:
                n[i], own_mean[i] = rec.delivered, rec.log_mean
                own_var[i] = max(rec.log_var, MIN_LOG_STD**2)
        # Normal-normal update of the device's mean log time: the profile is the prior.
        prior_prec = 1.0 / PRIOR_LOG_STD**2
        data_prec = n / own_var
        post_var = 1.0 / (prior_prec + data_prec)
        mean = post_var * (prior * prior_prec + own_mean * data_prec)
        # Predicting one more round: the device's own round-to-round spread plus what is
        # still unknown about its mean.
        spread = np.where(n > 0, own_var, 0.0)
        std = np.sqrt(post_var + spread)
        p_fail = (fails + 1.0) / (picks + 5.0)
        return Prediction(mean, std, p_fail)

    def _prior_seconds(
        self, job_id: str, gflops: np.ndarray, upload: np.ndarray, data: np.ndarray
    ) -> np.ndarray:
        """Profile-based guess: job-wide compute (per sample) and transfer constants over
        this device's speed, upload rate and samples; devices without a measurement get
        the fleet's median."""
        gflops = _fill_unmeasured(gflops)
        upload = _fill_unmeasured(upload)
        known = data[data > 0]
        # Samples relative to the candidates' median: 1 for a device that did not say, and
        # for every device when none did (the time model before devices reported data).
        typical = float(np.median(known)) if known.size else None
        size = _fill_unmeasured(data) / typical if typical else np.ones(len(data))
        work, volume = self._job_constants(job_id, typical)
        if work is None or volume is None:
            # Nothing delivered on this job yet: the default, slower for slower devices
            # and for more data.
            return np.asarray(self.default_s * float(np.median(gflops)) * size / gflops)
        return np.asarray(np.maximum(work * size / gflops + volume / upload, 1e-3))

    def _job_constants(
        self, job_id: str, typical: float | None
    ) -> tuple[float | None, float | None]:
        """(compute seconds x GFLOP/s for ``typical`` samples, transfer seconds x bytes/s),
        medians over the job's devices with a profile, or None before any delivered."""
        works, volumes = [], []
        for device_id, rec in self.history.job(job_id).items():
            profile = self.profile_of(device_id)
            if rec.delivered == 0 or profile is None:
                continue
            trained = profile.samples.get(self.task, 0) or rec.last_samples
            size = trained / typical if trained > 0 and typical else 1.0
            if profile.gflops > 0:
                works.append(rec.compute_s * profile.gflops / size)
            if profile.upload_bytes_per_s > 0:
                volumes.append(rec.transfer_s * profile.upload_bytes_per_s)
        if not works or not volumes:
            return None, None
        return float(np.median(works)), float(np.median(volumes))


def _fill_unmeasured(values: np.ndarray) -> np.ndarray:
    """Zeros (a device that measured nothing) become the median of the measured ones."""
    measured = values[values > 0]
    fill = float(np.median(measured)) if measured.size else 1.0
    return np.where(values > 0, values, fill)
