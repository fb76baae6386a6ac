"""Enrolled devices: enrolment, credentials, what each says it can do, and the pool's view.

The store keeps a device's measured numbers as a flat mapping; :func:`stored_profile` is
the one place that reads them back into a typed :class:`DeviceProfile`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping, Sequence

from flotilla.core.device import DeviceProfile, sample_counts
from flotilla.core.eligibility import EligibilitySection, ineligibility
from flotilla.core.errors import AuthError, ForbiddenError, WireError
from flotilla.core.events import DeviceChanged, EventSink, Fanout
from flotilla.core.identity import public_key as checked_key
from flotilla.core.records import DeviceRecord
from flotilla.core.work import DeviceCredential
from flotilla.scheduling import DevicePool, DeviceView
from flotilla.server.federation import auth
from flotilla.server.federation.store import Store, token_refusal
from flotilla.server.federation.views import DeviceInfo

#: Seconds a device listing may go without reading the store's devices afresh.
LISTING_REFRESH_S = 60.0
#: The longest device class a device may name (the store's column).
MAX_DEVICE_CLASS = 64


def stored_profile(record: DeviceRecord) -> DeviceProfile:
    """The typed profile of a stored device (numbers it never sent read as zero)."""
    numbers = record.profile
    return DeviceProfile(
        device_id=record.id,
        tasks=record.tasks,
        gflops=float(numbers.get("gflops", 0.0)),
        memory_bytes=int(numbers.get("memory_bytes", 0)),
        upload_bytes_per_s=float(numbers.get("upload_bytes_per_s", 0.0)),
        device_class=record.device_class,
        samples=dict(record.samples),
    )


def _check(profile: DeviceProfile) -> None:
    """The rules a profile from any edge must meet before anything of it is stored."""
    if len(profile.device_class) > MAX_DEVICE_CLASS:
        raise WireError(f"device class is longer than {MAX_DEVICE_CLASS} characters")
    sample_counts(profile.samples)


class Devices:
    """Enrolment and authentication against the store; sightings into the pool."""

    def __init__(
        self,
        store: Store,
        pool: DevicePool,
        clock: Callable[[], float],
        events: EventSink | None = None,
    ) -> None:
        """``events`` hears of enrolments and of devices coming back online."""
        self._events = Fanout(() if events is None else (events,))
        self._store = store
        self._pool = pool
        self._clock = clock
        #: Records of devices that authenticated since start, so a poll costs no query.
        self._known: dict[str, DeviceRecord] = {}
        #: Devices enrolled, ever (read at start, counted since): offline = this - online.
        self.enrolled = 0
        #: Every enrolled device's record, for listings: read from the store at most every
        #: ``LISTING_REFRESH_S`` (another server may share a PostgreSQL store), kept up to
        #: date here between reads, so a listing of a thousand devices costs no query.
        self._listing: dict[str, DeviceRecord] | None = None
        self._listed_at = 0.0

    async def start(self) -> None:
        self.enrolled = await self._store.count_devices()

    async def enrol(
        self,
        token: str,
        profile: DeviceProfile,
        device_id: str | None = None,
        public_key: str = "",
    ) -> DeviceCredential:
        """A new device and its credential. The token must be active (the store spends one
        of its uses in the insert's transaction); ``device_id``: the id the device's client
        certificate names (mutual TLS), refused when taken; None: a fresh one.
        ``public_key`` (hex Ed25519) is the key its updates are signed with: a device
        enrolled without one may poll and train, but its updates are refused (``no_key``)
        until it enrols again with a key."""
        if public_key:
            checked_key(public_key)
        now = self._clock()
        token_hash = auth.hash_secret(token) if token else ""
        if not token or (state := await self._store.enrol_token_state(token_hash, now)) != "active":
            raise AuthError(token_refusal("unknown" if not token else state))
        _check(profile)
        device_id = device_id or "dev-" + uuid.uuid4().hex[:12]
        secret = auth.new_secret()
        record = DeviceRecord(
            id=device_id,
            credential_hash=auth.hash_secret(secret),
            tasks=tuple(profile.tasks),
            profile=profile.numbers(),
            enrolled_at=now,
            last_seen_at=now,
            device_class=profile.device_class,
            public_key=public_key,
            samples=dict(profile.samples),
        )
        await self._store.add_device(record, token_hash, now)
        self._known[device_id] = record
        if self._listing is not None:
            self._listing[device_id] = record
        self.enrolled += 1
        self._events.emit(DeviceChanged(device_id, "enrolled"))
        return DeviceCredential(device_id, secret)

    async def authenticate(self, device_id: str | None, secret: str | None) -> DeviceRecord:
        if not device_id or not secret:
            raise AuthError("missing device credentials")
        record = self._known.get(device_id)
        if record is None:
            record = await self._store.get_device(device_id)
            if record is not None:
                self._known[device_id] = record
        if record is None or not auth.matches(secret, record.credential_hash):
            raise AuthError("device credentials refused")
        if record.revoked_at is not None:
            raise ForbiddenError(
                f"device {device_id} was revoked by the operator: its credential and key no "
                "longer work"
            )
        return record

    async def device_keys(self, device_ids: Sequence[str]) -> Mapping[str, bytes]:
        """The raw Ed25519 public keys registered at enrolment (``engine.DeviceKeys``: secure
        rounds verify key advertisements with them), of those of ``device_ids`` that have
        one and are not revoked."""
        keys: dict[str, bytes] = {}
        for device_id in device_ids:
            record = self._known.get(device_id) or await self._store.get_device(device_id)
            if record is not None and record.public_key and record.revoked_at is None:
                keys[device_id] = bytes.fromhex(record.public_key)
        return keys

    def revoked(self, device_id: str) -> bool:
        """Whether the device was revoked (as this server knows: it revokes through here)."""
        record = self._known.get(device_id)
        return record is not None and record.revoked_at is not None

    async def revoke(self, device_id: str) -> DeviceRecord:
        """Revoke a device now: every later call of it is refused, on every edge."""
        record = await self._store.revoke_device(device_id, self._clock())
        self._known[device_id] = record
        if self._listing is not None:
            self._listing[device_id] = record
        self._events.emit(DeviceChanged(device_id, "revoked"))
        return record

    async def seen(self, device: DeviceRecord, profile: DeviceProfile | None) -> None:
        """A device is alive (and idle by its own account); a new profile replaces the old."""
        if profile is not None:
            _check(profile)
            await self._store.update_device(
                device.id,
                profile=profile.numbers(),
                tasks=tuple(profile.tasks),
                device_class=profile.device_class,
                samples=profile.samples,
            )
            device = self._known[device.id] = await self._store.get_device(device.id) or device
            if self._listing is not None:
                self._listing[device.id] = device
        back = not self._pool.is_online(device.id)
        self._pool.seen(stored_profile(device))
        if back:
            self._events.emit(DeviceChanged(device.id, "online"))

    async def _records(self) -> list[DeviceRecord]:
        """Every enrolled device, in enrolment order (as the store lists them)."""
        now = time.monotonic()
        if self._listing is None or now - self._listed_at > LISTING_REFRESH_S:
            listing = {r.id: r for r in await self._store.list_devices()}
            listing.update(self._known)  # newer, and enrolled while that read ran
            self._listing, self._listed_at = listing, now
        return sorted(self._listing.values(), key=lambda r: (r.enrolled_at, r.id))

    async def infos(
        self,
        task: str = "",
        policy: EligibilitySection | None = None,
        running: Mapping[str, tuple[str, EligibilitySection]] | None = None,
    ) -> list[DeviceInfo]:
        """Every enrolled device: the pool's view of those seen since start, the rest offline.

        With ``task`` (and ``policy``, one job's ``[eligibility]``), an idle device they
        exclude is ``ineligible`` with the reason. ``running`` (job -> task, policy) adds
        why each running job may not select a device; an idle device no running job of its
        task may select is ``ineligible`` too, unless ``task`` was given.
        """
        views = {v.device_id: v for v in self._pool.describe(task, policy)}
        history = self._pool.history
        out = []
        for record in await self._records():
            view = views.get(record.id)
            records = [
                (job, rec)
                for job, devices in history.records.items()
                if (rec := devices.get(record.id)) is not None
            ]
            profile = stored_profile(record)
            excluded = _excluded_by(profile, view, running or {})
            state, reason = (view.state, view.reason) if view else ("offline", "")
            if record.revoked_at is not None:
                state, reason = "revoked", "revoked by the operator"
            if state == "idle" and not task and _every_job(profile, excluded, running or {}):
                state = "ineligible"
                reason = "; ".join(f"{job}: {why}" for job, why in sorted(excluded.items()))
            out.append(
                DeviceInfo(
                    id=record.id,
                    state=state,
                    job_id=view.job_id if view else "",
                    reason=reason,
                    tasks=record.tasks,
                    gflops=profile.gflops,
                    upload_bytes_per_s=profile.upload_bytes_per_s,
                    last_seen=view.last_seen if view else 0.0,
                    selected={job: rec.selected for job, rec in records},
                    delivered={job: rec.delivered for job, rec in records},
                    device_class=record.device_class,
                    conditions=view.conditions if view else None,
                    ineligible=excluded,
                    samples=dict(record.samples),
                )
            )
        return out


def _excluded_by(
    profile: DeviceProfile,
    view: DeviceView | None,
    running: Mapping[str, tuple[str, EligibilitySection]],
) -> dict[str, str]:
    """Running job -> why it may not select this device (jobs of other tasks left out)."""
    if view is None or view.state == "offline":
        return {}
    out = {}
    for job_id, (task, policy) in running.items():
        if task in profile.tasks and (why := ineligibility(policy, profile, view.conditions)):
            out[job_id] = why
    return out


def _every_job(
    profile: DeviceProfile,
    excluded: Mapping[str, str],
    running: Mapping[str, tuple[str, EligibilitySection]],
) -> bool:
    """Whether every running job of the device's tasks (at least one) excludes it."""
    mine = [job for job, (task, _) in running.items() if task in profile.tasks]
    return bool(mine) and all(job in excluded for job in mine)
