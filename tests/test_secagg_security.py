"""What the server can and cannot get out of SecAgg+: a masked input looks uniform, a lying
server gets no share that unmasks a live device, and bad, replayed, out-of-stage or
duplicate messages are refused with a reason."""

from __future__ import annotations

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from flotilla.secagg import SecAggMessageError, SecAggRefused, Stage
from flotilla.secagg import messages as msg
from flotilla.secagg.graph import neighbourhoods
from flotilla.secagg.keys import survivors_statement
from tests.support.secagg import SecAggRound, make_round

pytestmark = pytest.mark.timeout(60)

#: chi-square, 63 degrees of freedom: P(X > 110) < 2e-4 for uniform data.
CHI2_LIMIT_63 = 110.0


def _chi2(values: np.ndarray, modulus_bits: int) -> float:
    buckets = np.bincount((values >> np.uint64(modulus_bits - 6)).astype(np.int64), minlength=64)
    expected = values.size / 64
    return float(np.sum((buckets - expected) ** 2 / expected))


def _through(r: SecAggRound, last: Stage) -> dict[str, bytes]:
    """Run every device honestly up to and including ``last``; the server's replies."""
    inbox = {d: b"" for d in r.session.participants}
    for stage in Stage:
        for d in sorted(inbox):
            r.server.accept(d, stage, r.devices[d].respond(stage, inbox[d]))
        if stage == last:
            return inbox
        inbox = dict(r.server.close(stage))
    raise AssertionError("unreachable")


def test_a_masked_update_as_the_server_sees_it_is_uniform_mod_2_to_the_m() -> None:
    r = make_round(10, length=20_000)
    inbox = _through(r, Stage.SHARE)
    shares = r.server.close(Stage.SHARE)
    device = r.session.participants[3]
    body = r.devices[device].respond(Stage.MASKED_INPUT, shares[device])
    m = r.config.modulus_bits
    seen = msg.decode_masked_input(body, 20_001, m)
    assert _chi2(seen, m) < CHI2_LIMIT_63
    # the same test has power: the unmasked w*q is nowhere near uniform
    assert _chi2(r.quantized(device), m) > 100 * CHI2_LIMIT_63
    assert inbox  # the stages before ran for everyone


def _sign_and_forward(
    r: SecAggRound, lists: dict[str, msg.SurvivorList]
) -> tuple[dict[str, bytes], dict[str, str]]:
    """A lying server: hand each device its own survivor list, collect the signatures,
    forward each device its neighbours' signatures over the list it got, then collect
    reveals. Returns the reveals by device and the refusals' reasons by device."""
    nbr = neighbourhoods(r.session, r.config.neighbours)
    signatures: dict[str, bytes] = {}
    refusals: dict[str, str] = {}
    for d, lst in lists.items():
        try:
            body = r.devices[d].respond(Stage.CONSISTENCY, msg.encode_survivors(lst))
            signatures[d] = msg.decode_signature(body)
        except SecAggRefused as exc:
            refusals[d] = exc.reason
    reveals: dict[str, bytes] = {}
    for d in signatures:
        mine = lists[d].survivors
        forwarded = tuple(
            (s, signatures[s]) for s in sorted(nbr[d] & signatures.keys()) if lists[s] == lists[d]
        )
        assert all(s in mine for s, _ in forwarded)
        try:
            reveals[d] = r.devices[d].respond(Stage.UNMASK, msg.encode_signatures(forwarded))
        except SecAggRefused as exc:
            refusals[d] = exc.reason
    return reveals, refusals


def _revealed(reveals: dict[str, bytes], owner: str, secret: msg.Secret) -> int:
    return sum(
        1
        for body in reveals.values()
        for e in msg.decode_unmask(body)
        if e.owner == owner and e.secret == secret
    )


def test_a_server_claiming_a_live_device_dropped_gets_no_share_of_its_self_mask() -> None:
    r = make_round(10, length=100)
    _through(r, Stage.MASKED_INPUT)  # the server holds every masked input
    everyone = r.session.participants
    victim = everyone[4]
    lie = msg.SurvivorList(tuple(d for d in everyone if d != victim), (victim,))
    reveals, refusals = _sign_and_forward(r, {d: lie for d in everyone})
    assert refusals == {victim: "listed as dropped"}
    # the server learns the victim's mask key, which alone leaves PRG(b_victim) on its input
    assert _revealed(reveals, victim, msg.Secret.MASK_KEY) >= r.config.threshold
    assert _revealed(reveals, victim, msg.Secret.SELF_MASK) == 0


def test_a_server_telling_neighbours_different_stories_is_refused_by_all() -> None:
    r = make_round(10, length=100)
    _through(r, Stage.MASKED_INPUT)
    everyone = r.session.participants
    victim = everyone[4]
    around = sorted(neighbourhoods(r.session, r.config.neighbours)[victim])
    others = [d for d in everyone if d != victim and d not in around]
    truth = msg.SurvivorList(everyone, ())
    lie = msg.SurvivorList(tuple(d for d in everyone if d != victim), (victim,))
    half = len(around) // 2
    lists = {d: truth for d in [victim, *around[:half]]}
    lists.update({d: lie for d in [*around[half:], *others]})
    reveals, refusals = _sign_and_forward(r, lists)
    assert _revealed(reveals, victim, msg.Secret.SELF_MASK) < r.config.threshold
    assert _revealed(reveals, victim, msg.Secret.MASK_KEY) < r.config.threshold
    assert reveals == {}
    assert set(refusals.values()) == {"too few signatures"}
    assert set(refusals) == set(everyone)


def test_forged_survivor_signatures_are_refused() -> None:
    r = make_round(6, length=10)
    inbox = _through(r, Stage.CONSISTENCY)
    assert inbox
    lists = r.server.close(Stage.CONSISTENCY)
    device = sorted(lists)[0]
    forged = tuple(
        (s, Ed25519PrivateKey.generate().sign(b"x"))
        for s, _ in msg.decode_signatures(lists[device])
    )
    with pytest.raises(SecAggRefused) as err:
        r.devices[device].respond(Stage.UNMASK, msg.encode_signatures(forged))
    assert err.value.reason == "bad signature"
    with pytest.raises(SecAggRefused, match="out of stage"):  # a refusal is final
        r.devices[device].respond(Stage.UNMASK, lists[device])


def test_the_server_refuses_an_advertisement_signed_by_another_device() -> None:
    r = make_round(5, length=10)
    a, b = r.session.participants[:2]
    body = r.devices[a].respond(Stage.ADVERTISE, b"")
    with pytest.raises(SecAggMessageError) as err:
        r.server.accept(b, Stage.ADVERTISE, body)
    assert err.value.reason == "bad signature"
    r.server.accept(a, Stage.ADVERTISE, body)  # the refusal kept nothing: a's own still goes


def test_a_device_refuses_a_neighbour_advertisement_with_a_swapped_identity_key() -> None:
    r = make_round(5, length=10)
    adverts = _through(r, Stage.ADVERTISE)
    assert adverts
    lists = r.server.close(Stage.ADVERTISE)
    device = sorted(lists)[0]
    entries = msg.decode_advert_list(lists[device])
    stranger = Ed25519PrivateKey.generate().public_key().public_bytes_raw()
    tampered = (
        entries[0].__class__(
            entries[0].device_id, stranger, entries[0].c_pk, entries[0].s_pk, entries[0].signature
        ),
        *entries[1:],
    )
    with pytest.raises(SecAggRefused) as err:
        r.devices[device].respond(Stage.SHARE, msg.encode_advert_list(tampered))
    assert err.value.reason == "bad signature"


def test_an_advertisement_replayed_in_the_next_round_is_refused() -> None:
    first = make_round(4, length=10, round=1)
    second = make_round(4, length=10, round=2)
    device = first.session.participants[0]
    old = first.devices[device].respond(Stage.ADVERTISE, b"")
    server = second.server.__class__(second.config, second.session, first.device_keys, length=10)
    with pytest.raises(SecAggMessageError, match="bad signature"):
        server.accept(device, Stage.ADVERTISE, old)


def test_shares_sealed_for_another_round_do_not_open() -> None:
    r = make_round(4, length=10, round=1)
    _through(r, Stage.SHARE)
    lists = r.server.close(Stage.SHARE)
    device = sorted(lists)[0]
    entries = msg.decode_sealed(lists[device], msg.Kind.SHARE_LIST)
    flipped = entries[0].ciphertext[:-1] + bytes([entries[0].ciphertext[-1] ^ 1])
    bad = (msg.Sealed(entries[0].peer, flipped), *entries[1:])
    with pytest.raises(SecAggRefused) as err:
        r.devices[device].respond(Stage.MASKED_INPUT, msg.encode_sealed(msg.Kind.SHARE_LIST, bad))
    assert err.value.reason == "decryption failed"


def test_out_of_stage_duplicate_unknown_and_malformed_messages_are_refused() -> None:
    r = make_round(4, length=10)
    a = r.session.participants[0]
    body = r.devices[a].respond(Stage.ADVERTISE, b"")
    with pytest.raises(SecAggMessageError, match="out of stage"):
        r.server.accept(a, Stage.SHARE, body)
    with pytest.raises(SecAggMessageError, match="unknown device"):
        r.server.accept("dev-999", Stage.ADVERTISE, body)
    with pytest.raises(SecAggMessageError, match="malformed"):
        r.server.accept(a, Stage.ADVERTISE, body[:-1])
    with pytest.raises(SecAggMessageError, match="wrong version"):
        r.server.accept(a, Stage.ADVERTISE, body[:3] + b"\x09" + body[4:])
    r.server.accept(a, Stage.ADVERTISE, body)
    with pytest.raises(SecAggMessageError, match="duplicate"):
        r.server.accept(a, Stage.ADVERTISE, body)
    with pytest.raises(SecAggRefused, match="out of stage"):
        r.devices[a].respond(Stage.ADVERTISE, b"")
    with pytest.raises(SecAggRefused, match="out of stage"):
        r.devices[a].respond(Stage.UNMASK, b"")
    with pytest.raises(SecAggRefused, match="malformed"):
        r.devices[a].respond(Stage.SHARE, b"FSA\x01\x02\xff\xff")


def test_survivor_lists_that_overlap_or_leave_out_a_neighbour_are_refused() -> None:
    r = make_round(6, length=10)
    _through(r, Stage.MASKED_INPUT)
    everyone = r.session.participants
    a, b = everyone[0], everyone[1]
    both = msg.SurvivorList(everyone, (b,))
    with pytest.raises(SecAggRefused, match="inconsistent survivors"):
        r.devices[a].respond(Stage.CONSISTENCY, msg.encode_survivors(both))
    missing = msg.SurvivorList(tuple(d for d in everyone if d != b), ())  # b in neither
    with pytest.raises(SecAggRefused, match="inconsistent survivors"):
        r.devices[everyone[2]].respond(Stage.CONSISTENCY, msg.encode_survivors(missing))
    assert survivors_statement("j", 1, ("a",)) != survivors_statement("j", 2, ("a",))
