"""Devices and jobs described by numbers, not ids: what the learned selectors see.

A learned selector must generalize to devices it has never selected and to fleets it was
not trained on, so it sees what the duration model and the history say about a device,
never who the device is. Every feature is scaled to roughly unit range.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from flotilla.core.device import DeviceProfile
from flotilla.scheduling.duration import DurationModel

#: Columns of :func:`device_features`, in order.
DEVICE_FEATURES = (
    "log_seconds",  # predicted median round time, log, relative to the deadline
    "log_std",  # uncertainty of that prediction
    "p_fail",  # odds it delivers nothing
    "share",  # how often it was picked for this job, relative to the average device
    "staleness",  # rounds since it last served this job, relative to the job's rounds
    "loss",  # last training loss it reported, relative to the candidates' mean
    "explored",  # 1 once it has delivered for this job
    "data",  # log of its samples for the task over the candidates' median (0: unknown)
)


def device_features(
    model: DurationModel, job_id: str, candidates: Sequence[DeviceProfile], deadline_s: float
) -> np.ndarray:
    """``(len(candidates), len(DEVICE_FEATURES))`` float32."""
    pred = model.predict(job_id, candidates)
    history = model.history
    records = history.job(job_id)
    rounds = max(history.rounds.get(job_id, 0), 1)
    recs = [records.get(c.device_id) for c in candidates]
    picked = np.array([r.selected if r else 0 for r in recs], dtype=np.float64)
    last = np.array([r.last_round if r else 0 for r in recs], dtype=np.float64)
    losses = np.array(
        [r.last_loss if r is not None and r.last_loss is not None else np.nan for r in recs]
    )
    known = ~np.isnan(losses)
    mean_loss = float(losses[known].mean()) if known.any() else 1.0
    loss = np.where(known, losses / max(mean_loss, 1e-6), 1.0)
    delivered = np.array([1.0 if r is not None and r.delivered else 0.0 for r in recs])
    # Filling the unknown with the median leaves the median as it was: they score 0.
    samples = model.filled_samples(job_id, candidates)
    data = np.log(samples / float(np.median(samples)))
    out = np.stack(
        [
            pred.log_mean - math.log(max(deadline_s, 1e-3)),
            pred.log_std,
            pred.p_fail,
            picked / max(float(picked.mean()), 1e-6) if picked.any() else picked,
            np.where(last > 0, (rounds - last) / rounds, 1.0),
            np.clip(loss, 0.0, 10.0),
            delivered,
            data,
        ],
        axis=1,
    )
    return out.astype(np.float32)


def job_features(candidates: int, want: int, rounds: int, total_rounds: int) -> np.ndarray:
    """What a job's state looks like to a policy: scarcity and progress."""
    return np.array(
        [want / max(candidates, 1), min(rounds / max(total_rounds, 1), 1.0)], dtype=np.float32
    )
