"""Enrolment tokens with limits: a use count, an expiry, revocation; each refusal says
which, an unknown token is just refused; the last use cannot be spent twice, on either
database; the ``token`` commands list and revoke by id."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from flotilla.core.device import DeviceProfile
from flotilla.core.errors import AuthError, ConflictError, NotFoundError, SpecError
from flotilla.scheduling import DevicePool
from flotilla.server.federation import auth
from flotilla.server.federation.devices import Devices
from flotilla.server.federation.store import Store
from flotilla.server.federation.tokens import parse_duration
from tests.support.live_grpc import run_cli

pytestmark = pytest.mark.timeout(60)

PROFILE = DeviceProfile("", tasks=("t",))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


async def _token(store: Store, uses: int | None = None, expires_at: float | None = None) -> str:
    token = auth.new_secret()
    token_id = await store.add_enrol_token(auth.hash_secret(token), uses, expires_at)
    assert token_id == auth.hash_secret(token)[:12]
    return token


async def test_a_token_admits_its_uses_until_it_expires_or_is_revoked(store: Store) -> None:
    clock = Clock()
    devices = Devices(store, DevicePool(clock=clock), clock)
    two = await _token(store, uses=2)
    await devices.enrol(two, PROFILE)
    await devices.enrol(two, PROFILE)
    with pytest.raises(AuthError, match="enrolment token refused: used up"):
        await devices.enrol(two, PROFILE)

    soon = await _token(store, expires_at=clock.now + 60)
    await devices.enrol(soon, PROFILE)
    clock.now += 61
    with pytest.raises(AuthError, match="enrolment token refused: expired"):
        await devices.enrol(soon, PROFILE)

    forever = await _token(store)
    for _ in range(3):
        await devices.enrol(forever, PROFILE)
    revoked = await store.revoke_enrol_token(auth.hash_secret(forever)[:12], clock.now)
    assert revoked.state == "revoked" and revoked.uses_left is None
    with pytest.raises(AuthError, match="enrolment token refused: revoked"):
        await devices.enrol(forever, PROFILE)

    for unknown in ("never-minted", ""):
        with pytest.raises(AuthError) as info:
            await devices.enrol(unknown, PROFILE)
        assert str(info.value) == "enrolment token refused"  # nothing about which exist
    assert len(await store.list_devices()) == 6

    listed = {t.id: t for t in await store.list_enrol_tokens(clock.now)}
    assert listed[auth.hash_secret(two)[:12]].uses_left == 0
    assert {t.state for t in listed.values()} == {"used up", "expired", "revoked"}


async def test_a_refused_enrolment_spends_no_use(store: Store) -> None:
    clock = Clock()
    devices = Devices(store, DevicePool(clock=clock), clock)
    one = await _token(store, uses=1)
    await devices.enrol(await _token(store), PROFILE, device_id="dev-taken")
    with pytest.raises(ConflictError):  # the id a certificate names is taken
        await devices.enrol(one, PROFILE, device_id="dev-taken")
    (t,) = [t for t in await store.list_enrol_tokens(clock.now) if t.uses_left is not None]
    assert t.uses_left == 1 and t.state == "active"
    assert (await devices.enrol(one, PROFILE, device_id="dev-mine")).device_id == "dev-mine"


async def test_two_devices_racing_for_the_last_use_cannot_both_enrol(
    store: Store, db_url: str
) -> None:
    """Each racer on a connection pool of its own, as two servers sharing a database."""
    clock = Clock()
    token = await _token(store, uses=1)
    others = [await Store.open(db_url) for _ in range(3)]
    try:
        racers = [Devices(s, DevicePool(clock=clock), clock) for s in (store, *others)]
        for _ in range(5):  # and again with a fresh token, so the race is run more than once
            results = await asyncio.gather(
                *(d.enrol(token, PROFILE) for d in racers), return_exceptions=True
            )
            won = [r for r in results if not isinstance(r, BaseException)]
            lost = [r for r in results if isinstance(r, BaseException)]
            assert len(won) == 1, results
            assert all(isinstance(e, AuthError) and "used up" in str(e) for e in lost), lost
            token = await _token(store, uses=1)
    finally:
        for s in others:
            await s.close()
    assert len(await store.list_devices()) == 5


async def test_revoking_needs_an_id_that_names_one_token(store: Store) -> None:
    with pytest.raises(NotFoundError, match="at least 12 hex"):
        await store.revoke_enrol_token("abc", 0.0)
    with pytest.raises(NotFoundError, match="no enrolment token"):
        await store.revoke_enrol_token("0" * 12, 0.0)
    with pytest.raises(NotFoundError, match="hex"):
        await store.revoke_enrol_token("%" * 12, 0.0)


def test_durations() -> None:
    assert [parse_duration(t) for t in ("30s", "30m", "24h", "7d")] == [30, 1800, 86400, 604800]
    for bad in ("", "10", "1w", "-1h", "0m", "1.5h", "99999999d"):
        with pytest.raises(SpecError, match="--expires"):
            parse_duration(bad)


async def test_token_commands_create_list_and_revoke(tmp_path: Path) -> None:
    state = str(tmp_path / "state")
    made = await run_cli("server", "token", "create", "--state-dir", state, "--uses", "2",
                         "--expires", "24h")  # fmt: skip
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip()
    token_id = auth.hash_secret(token)[:12]
    assert f"token id {token_id}: 2 uses" in made.stderr
    listed = await run_cli("server", "token", "list", "--state-dir", state, "--json")
    (row,) = json.loads(listed.stdout)
    assert (row["id"], row["uses_left"], row["state"]) == (token_id, 2, "active")
    assert row["expires_at"] - row["created_at"] == pytest.approx(86400, abs=5)
    gone = await run_cli("server", "token", "revoke", token_id, "--state-dir", state)
    assert gone.returncode == 0 and f"token {token_id} revoked" in gone.stdout, gone.stderr
    table = await run_cli("server", "token", "list", "--state-dir", state)
    assert token_id in table.stdout and "revoked" in table.stdout
    bad = await run_cli("server", "token", "create", "--state-dir", state, "--expires", "soon")
    assert bad.returncode == 2 and "--expires" in bad.stderr
    unknown = await run_cli("server", "token", "revoke", "f" * 12, "--state-dir", state)
    assert unknown.returncode == 4 and "no enrolment token" in unknown.stderr
