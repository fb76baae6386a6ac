"""``flotilla job export ID --format executorch --out DIR``: a job's model as an on-device
training program (``DIR/model.pte``) and its manifest (``DIR/manifest.json``).

The model comes from the server like any export (safetensors, checked by SHA-256, decoded
without pickle); the job's spec names the task, which must be installed here.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING

from flotilla.core.blobs import sha256_hex
from flotilla.core.errors import SpecError, Unreachable
from flotilla.core.spec import JobSpec

if TYPE_CHECKING:
    from flotilla.cli.remote import RemoteServer
    from flotilla.mobile.export import ExportSource

#: Tries to read a model between two identical round counts before giving up.
ROUND_TRIES = 3


async def fetch_source(remote: RemoteServer, job_id: str) -> ExportSource:
    """The job's latest model and the round it belongs to.

    A round may commit while the model downloads, so the round count is read before and
    after: equal counts mean the model is that round's.
    """
    from flotilla.mobile.export import ExportSource

    for _ in range(ROUND_TRIES):
        before = await remote.job(job_id)
        model = await remote.export(job_id)
        after = await remote.job(job_id)
        if before.rounds_committed == after.rounds_committed:
            spec = JobSpec.from_json(after.spec_json, f"job {after.id}")
            return ExportSource(after.id, after.rounds_committed, spec, model)
    raise Unreachable(
        f"job {job_id} committed a round during each of {ROUND_TRIES} downloads; try again"
    )


def export_executorch(args: argparse.Namespace, remote: RemoteServer) -> int:
    """Fetch, check the task can be exported, lower, write; print what was written."""
    from flotilla.mobile.export import (
        build_training_program,
        check_exportable_job,
        executorch_version,
        exportable_task,
        write_program,
    )

    if args.out.exists() and not args.out.is_dir():
        raise SpecError(f"--out {args.out}: --format executorch writes a directory")

    async def fetch() -> ExportSource:
        async with remote:
            return await fetch_source(remote, args.job_id)

    source = asyncio.run(fetch())
    check_exportable_job(source.spec)  # say what is wrong before the slow work
    exportable_task(source.spec.job.task)
    executorch_version()
    exported = build_training_program(source)
    pte, manifest = write_program(exported, args.out)
    print(
        f"job {source.job_id} round {source.round} (model {sha256_hex(source.model)[:12]}): "
        f"wrote {pte} ({exported.manifest.program.size} bytes) and {manifest}"
    )
    return 0
