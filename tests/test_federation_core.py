"""The server core with no edge at all: what an HTTP edge (or an in-process test) calls.

Devices enrol, authenticate, poll and leave; operators list devices and volunteer runs;
wrong input raises the core's errors, never a transport's.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest

from flotilla.core.device import DeviceProfile
from flotilla.core.errors import AuthError, NotFoundError, StaleRoundError, WireError
from flotilla.core.timeouts import Timeouts
from flotilla.core.work import RoundRef, UploadHeader
from flotilla.engine import EngineConfig
from flotilla.server.federation import auth
from flotilla.server.federation.budget import ByteBudget
from flotilla.server.federation.facade import Federation, FederationConfig
from flotilla.server.federation.ports import Hosted
from flotilla.server.federation.store import Store, default_url
from flotilla.server.federation.views import VolunteerRunInfo
from flotilla.tasks.runtime import LocalTasks

pytestmark = pytest.mark.timeout(60)

DIGITS = "flotilla.tasks.digits:DigitsTask"


class FakeRendezvous:
    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    async def peers(self) -> tuple[str, ...]:
        return ("/ip4/127.0.0.1/tcp/1",)

    def peer_seen(self, device_id: str, peer_id: str) -> None:
        if not peer_id.isalnum():
            raise WireError(f"{peer_id!r} is not a peer id")
        self.seen[device_id] = peer_id

    def members(self, device_ids: Iterable[str]) -> dict[str, str]:
        return {self.seen[d]: d for d in device_ids if d in self.seen}


class FakeVolunteers:
    def infos(self) -> list[VolunteerRunInfo]:
        return [VolunteerRunInfo("lm", "a.b:C", ("/ip4/127.0.0.1/tcp/2",), "key", "")]


@pytest.fixture
async def core(tmp_path: Path) -> AsyncIterator[tuple[Federation, Store, FakeRendezvous]]:
    store = await Store.open(default_url(tmp_path))
    rendezvous = FakeRendezvous()
    config = FederationConfig(
        state_dir=tmp_path,
        timeouts=Timeouts(poll_hold_s=0.05, liveness_s=30.0),
        engine=EngineConfig(selection_grace_s=0.1),
    )
    federation = Federation(
        config, store, ByteBudget(1 << 20), Hosted(rendezvous, FakeVolunteers()), LocalTasks()
    )
    await federation.start()
    try:
        yield federation, store, rendezvous
    finally:
        await federation.close()
        await store.close()


async def _enrol_token(store: Store) -> str:
    token = auth.new_secret()
    await store.add_enrol_token(auth.hash_secret(token))
    return token


async def test_a_device_enrols_authenticates_polls_and_is_listed_with_its_profile(
    core: tuple[Federation, Store, FakeRendezvous],
) -> None:
    federation, store, rendezvous = core
    with pytest.raises(AuthError, match="enrolment token refused"):
        await federation.enrol("wrong", DeviceProfile(""))
    profile = DeviceProfile("", tasks=(DIGITS,), gflops=12.5, upload_bytes_per_s=3e6)
    enrolment = await federation.enrol(await _enrol_token(store), profile)
    for device_id, secret in [(enrolment.device_id, "wrong"), (None, enrolment.secret)]:
        with pytest.raises(AuthError):
            await federation.authenticate_device(device_id, secret)
    device = await federation.authenticate_device(enrolment.device_id, enrolment.secret)

    (offline,) = await federation.list_devices()
    assert (offline.state, offline.gflops, offline.last_seen) == ("offline", 12.5, 0.0)
    with pytest.raises(WireError, match="peer id"):
        await federation.poll(device, None, "not a peer id!")
    assert await federation.poll(device, None, "QmPeer") is None  # no job: nothing to do
    assert rendezvous.seen == {device.id: "QmPeer"}
    (idle,) = await federation.list_devices()
    assert idle.state == "idle" and idle.tasks == (DIGITS,)
    assert idle.upload_bytes_per_s == 3e6 and idle.last_seen > 0
    (ineligible,) = await federation.list_devices("other.task:T")
    assert ineligible.state == "ineligible"

    federation.leave(device, "bye")
    (gone,) = await federation.list_devices()
    assert gone.state == "offline"


async def test_uploads_and_downloads_outside_an_open_round_are_stale(
    core: tuple[Federation, Store, FakeRendezvous],
) -> None:
    federation, store, _ = core
    enrolment = await federation.enrol(await _enrol_token(store), DeviceProfile(""))
    device = await federation.authenticate_device(enrolment.device_id, enrolment.secret)
    ref = RoundRef("job-x", 1, "token")
    with pytest.raises(StaleRoundError):
        await federation.reserve_upload(device, ref, 10)

    async def payload() -> AsyncIterator[bytes]:
        yield b"x" * 10

    header = UploadHeader(ref, num_samples=1, payload_size=10, payload_sha256="0" * 64, codec="")
    with pytest.raises(StaleRoundError):
        await federation.submit_update(device, header, payload())
    with pytest.raises(StaleRoundError, match="not assigned"):
        await anext(federation.fetch_model(device, "0" * 64))
    assert federation.heartbeat(device, "token") is False


async def test_operators_see_jobs_and_runs_and_unknown_jobs_are_not_found(
    core: tuple[Federation, Store, FakeRendezvous],
) -> None:
    federation, _, _ = core
    assert await federation.list_jobs() == []
    for call in (federation.get_job("job-nope"), federation.cancel_job("job-nope")):
        with pytest.raises(NotFoundError, match="unknown job 'job-nope'"):
            await call
    with pytest.raises(NotFoundError):
        await anext(federation.export_model("job-nope"))
    (run,) = federation.volunteer_runs()
    assert run.run == "lm" and run.maddrs == ("/ip4/127.0.0.1/tcp/2",)
