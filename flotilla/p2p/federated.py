"""The agent's side of a server-less federated round (``[aggregation] transport = "p2p"``).

The server selects the round's agents and names their group (the round token); each agent
trains, then all-reduces its weighted update with the others through hivemind
(:class:`~flotilla.p2p.averaging.AgreedAverager`: whole-or-nothing, and every member ends
with the same bits), applies the average to the round's model and reports the new model's
SHA-256. The server commits the model only when a quorum of reports agree on it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from flotilla.core.allreduce import Contribution, GroupAgreement, GroupPlan, PeerOptions
from flotilla.core.errors import FlotillaError
from flotilla.core.tensors import ModelState


@dataclass(frozen=True, slots=True)
class AgreedAverage:
    """What one agent's all-reduce produced: the group's weighted mean update."""

    delta: ModelState
    contributors: tuple[Contribution, ...]
    group_id: str
    seconds: float
    #: Attempts reverted (incomplete) before the committed one.
    reverted: int = 0


class UpdateAverager:
    """An agent's hivemind peer: one DHT for the agent's life, one averager per round (its
    group key is the round token, so attempts of a round never mix)."""

    def __init__(self, options: PeerOptions | None = None) -> None:
        self.options = options or PeerOptions()
        self._dht: Any = None
        self._peers: tuple[str, ...] = ()

    def _dht_for(self, initial_peers: Sequence[str]) -> Any:
        from flotilla.p2p.dht import start_dht

        if self._dht is not None and tuple(initial_peers) != self._peers:
            self.shutdown()  # the server's rendezvous moved (a restart): join it afresh
        if self._dht is None:
            opts = self.options
            self._dht = start_dht(
                initial_peers,
                opts.host_maddrs,
                opts.client_mode,
                opts.identity_path,
                opts.announce_maddrs,
            )
            self._peers = tuple(initial_peers)
        return self._dht

    def average(
        self,
        group_key: str,
        plan: GroupPlan,
        delta: ModelState,
        me: Contribution,
        timeout_s: float,
    ) -> AgreedAverage:
        """All-reduce ``delta`` weighted by ``me.num_samples``; blocks at most ``timeout_s``.

        Raises FlotillaError when no complete round could be made in time: the caller then
        has nothing to report (the server's round goes on with the others)."""
        from flotilla.p2p.averaging import AgreedAverager
        from flotilla.p2p.codecs import hivemind_compression

        if timeout_s <= 1.0:
            raise FlotillaError("no time left in the round to average")
        names = sorted(delta)
        tensors = [torch.from_numpy(np.array(delta[n], dtype=np.float32)) for n in names]
        chunk = plan.chunk_timeout_s
        # Starting forks hivemind's averaging process; one that never gets ready is
        # killed and raises FlotillaError (``CompleteRounds.run_in_background``).
        averager = AgreedAverager(
            tensors,
            self._dht_for(plan.initial_peers),
            prefix=group_key,
            target_group_size=plan.group_size,
            min_group_size=plan.min_group_size,
            min_matchmaking_time=plan.matchmaking_s,
            request_timeout=min(3.0, plan.matchmaking_s / 2),
            allreduce_timeout=timeout_s,
            sender_timeout=chunk,
            reducer_timeout=2 * chunk,
            next_chunk_timeout=chunk,
            compression=hivemind_compression(plan.compression),
            members=plan.members,
            start=True,
        )
        try:
            try:
                result = averager.step(
                    gather=me.to_dict(), weight=float(me.num_samples), timeout=timeout_s
                )
            except Exception as exc:  # hivemind raises several kinds; all mean "no round"
                raise FlotillaError(f"all-reduce of {group_key} failed: {exc}") from exc
            if result is None:
                raise FlotillaError(f"all-reduce of {group_key} found no group in time")
            with averager.get_tensors() as averaged:
                out = {n: t.detach().numpy().copy() for n, t in zip(names, averaged, strict=True)}
        finally:
            averager.shutdown()
        contributors = tuple(
            sorted(
                (Contribution.from_dict(g) for g in result.gathered.values()),
                key=lambda c: c.device_id,
            )
        )
        return AgreedAverage(
            out, contributors, result.group_id, result.seconds, len(result.reverted)
        )

    def agree(
        self,
        group_key: str,
        base: memoryview,
        delta: ModelState,
        me: Contribution,
        timeout_s: float,
        config: Any,
    ) -> GroupAgreement:
        """One server-less round for an agent (:class:`~flotilla.core.allreduce.GroupAveraging`):
        all-reduce, then the model the group agreed on and the upload."""
        agreed = self.average(group_key, config.p2p, delta, me, timeout_s)
        sha, upload = agreed_model(base, agreed, config)
        return GroupAgreement(
            sha, upload, agreed.contributors, agreed.group_id, agreed.seconds, agreed.reverted
        )

    def shutdown(self) -> None:
        if self._dht is not None:
            self._dht.shutdown()
            self._dht = None


def agreed_model(base: memoryview, agreed: AgreedAverage, config: Any) -> tuple[str, bytes]:
    """SHA-256 of the next model (the round's model plus the group's average, built as the
    server will rebuild it), and the upload: the average as plain safetensors."""
    from flotilla.compression import apply_average
    from flotilla.compression.broadcast import decode_model
    from flotilla.core.tensors import encode_state, state_sha256

    global_state = decode_model(base, config)
    average = {name: agreed.delta[name] for name in global_state}
    model = apply_average(global_state, average, config.p2p.server_lr)
    return state_sha256(model), encode_state(average)
