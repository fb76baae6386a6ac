"""One device's side of a SecAgg+ round: a state machine fed the server's message for each
stage, answering with its own, and refusing (:class:`SecAggRefused`) whatever would be
unsafe: a bad signature, an inconsistent survivor list, too few neighbours left."""

from __future__ import annotations

import secrets
from collections.abc import Callable

import numpy as np
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from flotilla.secagg import keys, messages, shamir
from flotilla.secagg.config import SecAggConfig, Session, Stage
from flotilla.secagg.errors import SecAggMessageError, SecAggRefused
from flotilla.secagg.graph import neighbourhoods
from flotilla.secagg.messages import AdvertEntry, Reveal, Sealed, Secret, ShareBundle
from flotilla.secagg.prg import Expander
from flotilla.secagg.quantize import quantize, weighted


class SecAggDevice:
    """Quantizes and weights its update at construction (the first use of ``randbytes``),
    then answers the stages in order; each call gets the server's message for that stage."""

    def __init__(
        self,
        config: SecAggConfig,
        session: Session,
        device_id: str,
        identity: Ed25519PrivateKey,
        update: np.ndarray,
        weight: int,
        randbytes: Callable[[int], bytes] = secrets.token_bytes,
    ) -> None:
        flat = np.asarray(update).reshape(-1)
        config.check(len(session.participants), flat.size)
        if device_id not in session.participants:
            raise ValueError(f"secagg: {device_id!r} is not a participant of this round")
        self.config, self.session, self.device_id = config, session, device_id
        self._identity = identity
        self._randbytes = randbytes
        self._input = weighted(quantize(flat, config, randbytes), weight, config)
        self._keys = keys.RoundKeys.generate(randbytes)
        self._self_seed = randbytes(keys.KEY_BYTES)
        self._neighbours = neighbourhoods(session, config.neighbours)[device_id]
        self._next: Stage | None = Stage.ADVERTISE
        self._adverts: dict[str, AdvertEntry] = {}
        self._bundles: dict[str, ShareBundle] = {}  # shares we hold, by owner (U2 as seen)
        self._survivors: tuple[str, ...] = ()
        self._dropped: frozenset[str] = frozenset()
        self._revealed: dict[str, Secret] = {}

    def respond(self, stage: Stage, message: bytes) -> bytes:
        """This device's reply for ``stage``, given the server's message for it. After a
        refusal, or after UNMASK, every call is refused."""
        if self._next is None or stage != self._next:
            expected = self._next.name if self._next else "nothing (finished)"
            raise SecAggRefused("out of stage", f"expected {expected}, got {stage.name}")
        handlers = {
            Stage.ADVERTISE: self._advertise,
            Stage.SHARE: self._share,
            Stage.MASKED_INPUT: self._mask,
            Stage.CONSISTENCY: self._sign_survivors,
            Stage.UNMASK: self._unmask,
        }
        self._next = None  # until this stage succeeds: a refusal is final
        try:
            reply = handlers[stage](message)
        except SecAggMessageError as exc:
            raise SecAggRefused("malformed", str(exc)) from exc
        self._next = Stage(stage + 1) if stage < Stage.UNMASK else None
        return reply

    def _statement(self, device: str, c_pk: bytes, s_pk: bytes) -> bytes:
        return keys.advert_statement(self.session.job_id, self.session.round, device, c_pk, s_pk)

    def _advertise(self, message: bytes) -> bytes:
        if message:
            raise SecAggRefused("malformed", "ADVERTISE takes an empty message")
        c_pk, s_pk = self._keys.public()
        signature = keys.sign(self._identity, self._statement(self.device_id, c_pk, s_pk))
        return messages.encode_advertisement(messages.Advertisement(c_pk, s_pk, signature))

    def _share(self, message: bytes) -> bytes:
        entries = messages.decode_advert_list(message)
        for e in entries:
            if e.device_id not in self._neighbours:
                raise SecAggRefused("malformed", f"{e.device_id!r} is not a neighbour")
            if not keys.verify(
                e.identity_key, e.signature, self._statement(e.device_id, e.c_pk, e.s_pk)
            ):
                raise SecAggRefused("bad signature", f"advertisement of {e.device_id!r}")
        self._adverts = {e.device_id: e for e in entries}
        self._require(len(entries), "neighbours advertised")
        order = sorted(self._neighbours)  # share index = 1 + position among all neighbours
        xs = [1 + order.index(d) for d in sorted(self._adverts)]
        t = self.config.threshold
        b_shares = shamir.split(self._self_seed, t, xs, self._randbytes)
        s_shares = shamir.split(keys.private_bytes(self._keys.s_sk), t, xs, self._randbytes)
        sealed = []
        for peer, b, s in zip(sorted(self._adverts), b_shares, s_shares, strict=True):
            plain = messages.encode_bundle(ShareBundle(b, s))
            ct = keys.seal(
                self._keys.c_sk,
                self._adverts[peer].c_pk,
                self.session.job_id,
                self.session.round,
                self.device_id,
                peer,
                plain,
            )
            sealed.append(Sealed(peer, ct))
        return messages.encode_sealed(messages.Kind.SHARES, tuple(sealed))

    def _mask(self, message: bytes) -> bytes:
        entries = messages.decode_sealed(message, messages.Kind.SHARE_LIST)
        bundles = {}
        for e in entries:
            advert = self._adverts.get(e.peer)
            if advert is None:
                raise SecAggRefused("malformed", f"shares from {e.peer!r}, who did not advertise")
            plain = keys.open_sealed(
                self._keys.c_sk,
                advert.c_pk,
                self.session.job_id,
                self.session.round,
                e.peer,
                self.device_id,
                e.ciphertext,
            )
            if plain is None:
                raise SecAggRefused("decryption failed", f"shares from {e.peer!r}")
            bundles[e.peer] = messages.decode_bundle(plain)
        self._require(len(bundles), "neighbours shared")
        self._bundles = bundles
        values = self._input.copy()
        expander = Expander(values.size, self.config.modulus_bits)
        expander.add(values, self._self_seed, +1)
        for peer in sorted(bundles):
            seed = keys.mask_seed(
                self._keys.s_sk,
                self._adverts[peer].s_pk,
                self.session.job_id,
                self.session.round,
                self.device_id,
                peer,
            )
            expander.add(values, seed, keys.mask_sign(self.device_id, peer))
        return messages.encode_masked_input(expander.reduce(values), self.config.modulus_bits)

    def _sign_survivors(self, message: bytes) -> bytes:
        lists = messages.decode_survivors(message)
        survivors, dropped = set(lists.survivors), set(lists.dropped)
        everyone = set(self.session.participants)
        if survivors & dropped:
            raise SecAggRefused("inconsistent survivors", "a device is both alive and dropped")
        if not survivors | dropped <= everyone:
            raise SecAggRefused("inconsistent survivors", "lists name non-participants")
        if list(lists.survivors) != sorted(survivors):
            raise SecAggRefused("inconsistent survivors", "survivor list not sorted")
        if self.device_id not in survivors:
            raise SecAggRefused("listed as dropped", "the server says this device dropped")
        seen = set(self._bundles)
        mine = (survivors | dropped) & self._neighbours
        if not mine <= seen:
            raise SecAggRefused(
                "inconsistent survivors", "lists a neighbour whose shares this device never got"
            )
        if not seen <= survivors | dropped:
            raise SecAggRefused("inconsistent survivors", "a neighbour is in neither list")
        self._require(len(survivors & self._neighbours), "neighbours survived")
        self._survivors, self._dropped = lists.survivors, frozenset(dropped)
        statement = keys.survivors_statement(
            self.session.job_id, self.session.round, lists.survivors
        )
        return messages.encode_signature(keys.sign(self._identity, statement))

    def _unmask(self, message: bytes) -> bytes:
        entries = messages.decode_signatures(message)
        statement = keys.survivors_statement(
            self.session.job_id, self.session.round, self._survivors
        )
        alive = set(self._survivors)
        for device, signature in entries:
            if device not in self._neighbours or device not in alive or device == self.device_id:
                raise SecAggRefused("malformed", f"a signature from {device!r}")
            if not keys.verify(self._adverts[device].identity_key, signature, statement):
                raise SecAggRefused("bad signature", f"survivor list signed by {device!r}")
        if len(entries) < self.config.threshold:
            raise SecAggRefused(
                "too few signatures",
                f"{len(entries)} neighbours signed the survivor list, "
                f"{self.config.threshold} needed",
            )
        reveals = []
        for owner in sorted(self._bundles):
            secret = Secret.SELF_MASK if owner in alive else Secret.MASK_KEY
            if owner not in alive and owner not in self._dropped:
                continue  # checked at CONSISTENCY; kept as a guard
            if self._revealed.setdefault(owner, secret) != secret:
                raise SecAggRefused("double reveal", f"both secrets of {owner!r} asked for")
            bundle = self._bundles[owner]
            share = bundle.self_mask if secret == Secret.SELF_MASK else bundle.mask_key
            reveals.append(Reveal(owner, secret, share))
        return messages.encode_unmask(tuple(reveals))

    def _require(self, count: int, what: str) -> None:
        if count < self.config.threshold:
            raise SecAggRefused(
                "too few neighbours", f"{count} {what}, {self.config.threshold} needed"
            )
