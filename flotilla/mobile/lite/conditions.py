"""Device conditions on a light device: read from a JSON file at every poll and between
batches, judged by the job's ``[eligibility]`` policy with the server's own function.

The file (``--conditions FILE``) is a JSON object: ``charging`` (bool), ``battery`` (0..1),
``network`` (``unmetered``/``metered``/``unknown``), ``idle`` (bool), optionally
``thermal``. A phone SDK would ask the OS; the file lets a test unplug a device mid-round.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from flotilla.core.conditions import DeviceConditions
from flotilla.core.eligibility import EligibilitySection, ineligibility
from flotilla.core.errors import SpecError, WireError
from flotilla.mobile.lite.mlp import StopCheck

log = logging.getLogger(__name__)

#: Largest conditions file read: it holds five fields.
MAX_FILE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class LiteConditions:
    """Where this device's conditions come from; ``path`` None: it cannot tell (unknown)."""

    path: Path | None = None

    def read(self) -> DeviceConditions:
        """The conditions now; SpecError naming the file and what is wrong with it."""
        if self.path is None:
            return DeviceConditions()
        where = f"conditions file {self.path}"
        try:
            with self.path.open("rb") as fh:
                raw = fh.read(MAX_FILE_BYTES + 1)
            if len(raw) > MAX_FILE_BYTES:
                raise SpecError(f"{where}: larger than {MAX_FILE_BYTES} bytes")
            data = json.loads(raw)
            return DeviceConditions.from_dict(data, where)
        except (OSError, ValueError, RecursionError) as exc:
            raise SpecError(f"{where}: {exc}") from exc

    def current(self) -> DeviceConditions:
        """The conditions now, for a device at work: a file that cannot be read (being
        rewritten, deleted) reads as unknown, which no policy that asks for a condition
        accepts, so a device never trains on conditions it could not confirm."""
        try:
            return self.read()
        except SpecError as exc:
            log.warning("%s; conditions unknown until it reads again", exc)
            return DeviceConditions()


def job_policy(config_json: str) -> EligibilitySection | None:
    """The job's ``[eligibility]`` from a task's config JSON; None when it has none."""
    try:
        raw = json.loads(config_json)
    except (ValueError, RecursionError) as exc:
        raise WireError(f"task config is not JSON: {exc}") from exc
    section = raw.get("eligibility") if isinstance(raw, dict) else None
    if section is None:
        return None
    try:
        return EligibilitySection.from_dict(section)
    except SpecError as exc:
        raise WireError(f"task config: {exc}") from exc


def stop_check(policy: EligibilitySection | None, conditions: LiteConditions) -> StopCheck:
    """A ``should_stop`` for training: re-reads the conditions at every call and names the
    first one the policy no longer accepts (profile checks are the server's, at selection)."""

    def should_stop() -> str | None:
        if policy is None or not policy.needs_conditions:
            return None
        return ineligibility(policy, None, conditions.current())

    return should_stop
