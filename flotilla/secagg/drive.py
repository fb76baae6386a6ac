"""All stages of a SecAgg+ round in one process: for tests, the docs and the benchmark."""

from __future__ import annotations

from collections.abc import Mapping

from flotilla.secagg.config import SecAggConfig, Session, Stage
from flotilla.secagg.device import SecAggDevice
from flotilla.secagg.result import MaskedSum
from flotilla.secagg.server import SecAggServer


def run_in_process(
    config: SecAggConfig,
    session: Session,
    devices: Mapping[str, SecAggDevice],
    server: SecAggServer,
    drop_after: Mapping[str, Stage] | None = None,
) -> MaskedSum:
    """Device ``d`` stops answering after stage ``drop_after[d]`` (it answers that stage,
    then vanishes). A device's refusal propagates (SecAggRefused); so does an abort."""
    drops = drop_after or {}
    inbox: Mapping[str, bytes] = {d: b"" for d in session.participants}
    for stage in Stage:
        for device_id in sorted(inbox):
            last = drops.get(device_id)
            if last is not None and stage > last:
                continue
            reply = devices[device_id].respond(stage, inbox[device_id])
            server.accept(device_id, stage, reply)
        inbox = server.close(stage)
    return server.result()
