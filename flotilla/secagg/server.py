"""The server's side of a SecAgg+ round: it routes keys, sealed shares and signatures
between neighbours, sums the masked inputs as they come, and at the end removes the masks
it can reconstruct. It never holds an unmasked individual update."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from flotilla.core.errors import ConfigError
from flotilla.secagg import keys, messages, shamir
from flotilla.secagg.config import SecAggConfig, Session, Stage
from flotilla.secagg.errors import SecAggAborted, SecAggMessageError
from flotilla.secagg.graph import neighbourhoods
from flotilla.secagg.messages import Advertisement, Reveal, Secret, SurvivorList
from flotilla.secagg.prg import Expander
from flotilla.secagg.result import MaskedSum


class SecAggServer:
    """Accepts each stage's replies, then ``close`` gives each remaining device its
    message for the next stage. ``length`` (elements, weight not counted) fixes the update
    size up front; without it the first masked input sets it."""

    def __init__(
        self,
        config: SecAggConfig,
        session: Session,
        device_keys: Mapping[str, bytes],
        *,
        length: int | None = None,
    ) -> None:
        n = len(session.participants)
        config.check(n, length if length is not None else 1)
        missing = [d for d in session.participants if len(device_keys.get(d, b"")) != 32]
        if missing:
            raise ConfigError(f"secagg: no 32-byte device key for {missing[:5]}")
        self.config, self.session = config, session
        self._device_keys = {d: bytes(device_keys[d]) for d in session.participants}
        self._nbr = neighbourhoods(session, config.neighbours)
        self._length = length
        self._stage: Stage | None = Stage.ADVERTISE
        self._expected: frozenset[str] = frozenset(session.participants)
        self._adverts: dict[str, Advertisement] = {}
        self._sealed: dict[str, dict[str, bytes]] = {}
        self._acc: np.ndarray | None = None
        self._inputs: set[str] = set()
        self._survivors: tuple[str, ...] = ()
        self._dropped: tuple[str, ...] = ()
        self._survivors_statement = b""
        self._signatures: dict[str, bytes] = {}
        self._reveals: dict[str, tuple[Reveal, ...]] = {}
        self._result: MaskedSum | None = None
        #: Lagrange coefficients by share-index set: most owners' first t indices are alike.
        self._lagrange: dict[tuple[int, ...], tuple[int, ...]] = {}

    # -- accepting replies -------------------------------------------------------------

    def accept(self, device_id: str, stage: Stage, body: bytes) -> None:
        """Check and keep one device's reply (SecAggMessageError, nothing kept, if bad)."""
        if stage != self._stage:
            raise SecAggMessageError("out of stage", f"{stage.name} while {self._stage_name()}")
        if device_id not in self._expected:
            raise SecAggMessageError("unknown device", f"{device_id[:64]!r} at {stage.name}")
        if device_id in self._replied(stage):
            raise SecAggMessageError("duplicate", f"{device_id[:64]!r} at {stage.name}")
        if stage == Stage.ADVERTISE:
            self._accept_advert(device_id, body)
        elif stage == Stage.SHARE:
            self._accept_shares(device_id, body)
        elif stage == Stage.MASKED_INPUT:
            self._accept_input(device_id, body)
        elif stage == Stage.CONSISTENCY:
            self._accept_signature(device_id, body)
        else:
            self._accept_unmask(device_id, body)

    def _replied(self, stage: Stage) -> set[str]:
        if stage == Stage.ADVERTISE:
            return set(self._adverts)
        if stage == Stage.SHARE:
            return set(self._sealed)
        if stage == Stage.MASKED_INPUT:
            return self._inputs
        if stage == Stage.CONSISTENCY:
            return set(self._signatures)
        return set(self._reveals)

    def _accept_advert(self, device: str, body: bytes) -> None:
        msg = messages.decode_advertisement(body)
        statement = keys.advert_statement(
            self.session.job_id, self.session.round, device, msg.c_pk, msg.s_pk
        )
        if not keys.verify(self._device_keys[device], msg.signature, statement):
            raise SecAggMessageError("bad signature", f"advertisement of {device[:64]!r}")
        self._adverts[device] = msg

    def _accept_shares(self, device: str, body: bytes) -> None:
        entries = messages.decode_sealed(body, messages.Kind.SHARES)
        wanted = self._nbr[device] & self._adverts.keys()
        if {e.peer for e in entries} != wanted:
            raise SecAggMessageError("malformed", "shares not for exactly the live neighbours")
        self._sealed[device] = {e.peer: e.ciphertext for e in entries}

    def _accept_input(self, device: str, body: bytes) -> None:
        if self._length is None:
            count = messages.masked_input_count(body)
            self.config.check(len(self.session.participants), count - 1)
            values = messages.decode_masked_input(body, count, self.config.modulus_bits)
            self._length = count - 1
        else:
            words = self.config.words(self._length)
            values = messages.decode_masked_input(body, words, self.config.modulus_bits)
        if self._acc is None:
            self._acc = np.zeros(values.size, dtype=np.uint64)
        np.add(self._acc, values, out=self._acc)
        self._inputs.add(device)

    def _accept_signature(self, device: str, body: bytes) -> None:
        signature = messages.decode_signature(body)
        if not keys.verify(self._device_keys[device], signature, self._survivors_statement):
            raise SecAggMessageError("bad signature", f"survivor list of {device[:64]!r}")
        self._signatures[device] = signature

    def _accept_unmask(self, device: str, body: bytes) -> None:
        entries = messages.decode_unmask(body)
        alive = set(self._survivors)
        owners = self._nbr[device] & self._sealed.keys()
        if {e.owner for e in entries} != owners:
            raise SecAggMessageError("malformed", "reveals not for exactly the neighbours")
        for e in entries:
            if (e.secret == Secret.SELF_MASK) != (e.owner in alive):
                raise SecAggMessageError("malformed", f"wrong secret revealed for {e.owner!r}")
        self._reveals[device] = entries

    # -- closing stages ----------------------------------------------------------------

    def close(self, stage: Stage) -> Mapping[str, bytes]:
        """End ``stage``: each remaining device's message for the next one ({} after
        UNMASK). SecAggAborted when some neighbourhood has fewer than t left."""
        if stage != self._stage:
            raise SecAggAborted("out of stage", f"close {stage.name} while {self._stage_name()}")
        self._stage = None  # until this close succeeds: an abort is final
        if stage == Stage.ADVERTISE:
            out = self._close_adverts()
        elif stage == Stage.SHARE:
            out = self._close_shares()
        elif stage == Stage.MASKED_INPUT:
            out = self._close_inputs()
        elif stage == Stage.CONSISTENCY:
            out = self._close_signatures()
        else:
            self._result = self._unmask()
            return {}
        self._stage = Stage(stage + 1)
        self._expected = frozenset(out)
        return out

    def _enough(self, owners: set[str] | frozenset[str], alive: set[str], what: str) -> None:
        """Every owner keeps t live neighbours, or the round cannot complete."""
        t = self.config.threshold
        for owner in sorted(owners):
            if len(self._nbr[owner] & alive) < t:
                raise SecAggAborted(
                    "too few survivors",
                    f"{owner[:64]!r} has {len(self._nbr[owner] & alive)} neighbours {what}, "
                    f"{t} needed",
                )

    def _close_adverts(self) -> dict[str, bytes]:
        u1 = set(self._adverts)
        self._enough(u1, u1, "advertised")
        out = {}
        for device in sorted(u1):
            entries = tuple(
                messages.AdvertEntry(
                    d,
                    self._device_keys[d],
                    self._adverts[d].c_pk,
                    self._adverts[d].s_pk,
                    self._adverts[d].signature,
                )
                for d in sorted(self._nbr[device] & u1)
            )
            out[device] = messages.encode_advert_list(entries)
        return out

    def _close_shares(self) -> dict[str, bytes]:
        u2 = set(self._sealed)
        self._enough(u2, u2, "shared")
        out = {}
        for device in sorted(u2):
            entries = tuple(
                messages.Sealed(s, self._sealed[s][device]) for s in sorted(self._nbr[device] & u2)
            )
            out[device] = messages.encode_sealed(messages.Kind.SHARE_LIST, entries)
        return out

    def _close_inputs(self) -> dict[str, bytes]:
        u3 = set(self._inputs)
        self._enough(set(self._sealed), u3, "sent masked inputs")
        self._survivors = tuple(sorted(u3))
        self._dropped = tuple(sorted(set(self._sealed) - u3))
        self._survivors_statement = keys.survivors_statement(
            self.session.job_id, self.session.round, self._survivors
        )
        body = messages.encode_survivors(SurvivorList(self._survivors, self._dropped))
        return {d: body for d in self._survivors}

    def _close_signatures(self) -> dict[str, bytes]:
        signed = set(self._signatures)
        t = self.config.threshold
        ready = {d for d in signed if len(self._nbr[d] & signed) >= t}
        self._enough(set(self._sealed), ready, "can unmask")
        return {
            d: messages.encode_signatures(
                tuple((s, self._signatures[s]) for s in sorted(self._nbr[d] & signed))
            )
            for d in sorted(ready)
        }

    def _unmask(self) -> MaskedSum:
        by_owner: dict[str, list[shamir.Share]] = {}
        for device in sorted(self._reveals):
            for e in self._reveals[device]:
                by_owner.setdefault(e.owner, []).append(e.share)
        self._enough(set(self._sealed), set(self._reveals), "revealed shares")
        if self._acc is None or self._length is None:
            raise SecAggAborted("too few survivors", "no masked input arrived")
        acc = self._acc
        expander = Expander(acc.size, self.config.modulus_bits)
        for owner in self._survivors:
            expander.add(acc, self._secret(by_owner[owner]), -1)
        for owner in self._dropped:
            s_sk = X25519PrivateKey.from_private_bytes(self._secret(by_owner[owner]))
            if keys.raw_public(s_sk.public_key()) != self._adverts[owner].s_pk:
                raise SecAggAborted("reconstruction failed", f"mask key of {owner[:64]!r}")
            for peer in sorted(self._nbr[owner] & set(self._survivors)):
                seed = keys.mask_seed(
                    s_sk,
                    self._adverts[peer].s_pk,
                    self.session.job_id,
                    self.session.round,
                    owner,
                    peer,
                )
                # the survivor added sign(peer, owner) * PRG(seed); take it back out
                expander.add(acc, seed, -keys.mask_sign(peer, owner))
        expander.reduce(acc)
        return MaskedSum(
            values=acc[: self._length].copy(),
            total_weight=int(acc[self._length]),
            survivors=self._survivors,
        )

    def _secret(self, shares: list[shamir.Share]) -> bytes:
        try:
            return shamir.reconstruct(
                sorted(shares, key=lambda s: s.x), self.config.threshold, cache=self._lagrange
            )
        except ValueError as exc:
            raise SecAggAborted("reconstruction failed", str(exc)) from exc

    def result(self) -> MaskedSum:
        """The unmasked weighted sum, after ``close(Stage.UNMASK)``."""
        if self._result is None:
            raise SecAggAborted("out of stage", "no result before UNMASK closes")
        return self._result

    def _stage_name(self) -> str:
        return self._stage.name if self._stage is not None else "finished"
