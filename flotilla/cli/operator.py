"""``flotilla job ...`` and ``flotilla devices ...``: an operator's calls to a running server.

Every listing and status command takes ``--json``; ``job status --watch`` is in
:mod:`flotilla.cli.watch`, ``job plot`` in :mod:`flotilla.cli.plot`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flotilla.core.errors import SpecError

if TYPE_CHECKING:  # grpc is imported by the commands that call a server, not by --help
    from flotilla.cli.remote import RemoteServer


def add_job_parser(commands: Any) -> None:
    job = commands.add_parser("job", help="submit and inspect jobs on a server")
    sub = job.add_subparsers(title="job commands", metavar="ACTION")

    def add(name: str, help_text: str, handler: Callable[[argparse.Namespace], int]) -> Any:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--server", default="127.0.0.1:7070", help="HOST:PORT")
        p.add_argument("--state-dir", type=Path, default=None, help="reads operator.token here")
        p.add_argument("--token", default=None, help="operator token")
        _tls_arguments(p)
        p.set_defaults(handler=handler)
        return p

    submit = add("submit", "submit a job spec (prints the job id last)", _job_submit)
    submit.add_argument("spec", type=Path, help="a job spec, or an experiment file (its jobs)")
    submit.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    submit.add_argument("--job", default=None, help="of an experiment's jobs, only this one")
    submit.add_argument("--json", action="store_true", help="the submitted jobs as JSON")
    listing = add("list", "list jobs", _job_list)
    listing.add_argument("--json", action="store_true")
    status = add("status", "one job's state and metrics", _job_status)
    status.add_argument("job_id")
    status.add_argument("--json", action="store_true")
    status.add_argument("--rounds", action="store_true", help="include every round")
    status.add_argument(
        "--watch", action="store_true",
        help="redraw until the job ends; exit 0 completed, 1 failed or cancelled",
    )  # fmt: skip
    status.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    cancel = add("cancel", "cancel a job", _job_cancel)
    cancel.add_argument("job_id")
    cancel.add_argument("--json", action="store_true")
    plot = add("plot", "PNG charts of a job's rounds (the plots extra)", _job_plot)
    plot.add_argument("job_id")
    plot.add_argument("--out", type=Path, required=True, help="directory for the PNG files")
    export = add(
        "export",
        "download a job's latest model as safetensors, or as an ExecuTorch training program",
        _job_export,
    )
    export.add_argument("job_id")
    export.add_argument(
        "--out", type=Path, required=True,
        help="the .safetensors file; with --format executorch, a directory",
    )  # fmt: skip
    export.add_argument(
        "--format", choices=("safetensors", "executorch"), default="safetensors",
        help="executorch: DIR/model.pte (on-device training) and DIR/manifest.json; "
        "needs the mobile-export extra",
    )  # fmt: skip


def add_devices_parser(commands: Any) -> None:
    devices = commands.add_parser("devices", help="inspect the devices enrolled on a server")
    sub = devices.add_subparsers(title="device commands", metavar="ACTION")
    listing = sub.add_parser("list", help="every device: offline, idle, busy or ineligible")
    listing.add_argument("--server", default="127.0.0.1:7070", help="HOST:PORT")
    listing.add_argument("--state-dir", type=Path, default=None, help="reads operator.token here")
    listing.add_argument("--token", default=None, help="operator token")
    _tls_arguments(listing)
    listing.add_argument("--task", default="", help="mark devices without this task ineligible")
    listing.add_argument(
        "--job", default="", help="mark devices this job may not select now ineligible, and why"
    )
    listing.add_argument("--json", action="store_true")
    listing.set_defaults(handler=_devices_list)

    def add(name: str, help_text: str, handler: Callable[[argparse.Namespace], int]) -> Any:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("--server", default="127.0.0.1:7070", help="HOST:PORT")
        p.add_argument("--state-dir", type=Path, default=None, help="reads operator.token here")
        p.add_argument("--token", default=None, help="operator token")
        _tls_arguments(p)
        p.set_defaults(handler=handler)
        return p

    revoke = add(
        "revoke", "revoke a device now: its credential and key stop working", _devices_revoke
    )
    revoke.add_argument("device_id")
    revoke.add_argument("--json", action="store_true")
    refusals = add("refusals", "updates the server refused, newest first, and why", _refusals)
    refusals.add_argument("--device", default="", help="only this device's")
    refusals.add_argument("--job", default="", help="only those naming this job")
    refusals.add_argument("--limit", type=int, default=100, help="at most this many")
    refusals.add_argument("--json", action="store_true")


def _devices_revoke(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with _remote(args) as remote:
            reply = await remote.revoke(args.device_id)
        if args.json:
            print(json.dumps({"device_id": reply.device_id, "revoked_at": reply.revoked_at}))
        else:
            print(f"revoked {reply.device_id}")
        return 0

    return asyncio.run(go())


def _refusals(args: argparse.Namespace) -> int:
    async def go() -> int:
        async with _remote(args) as remote:
            found = await remote.refusals(args.device, args.job, max(args.limit, 1))
        rows: list[dict[str, Any]] = [
            {"at": r.at, "device_id": r.device_id, "job_id": r.job_id, "round": r.round,
             "reason": r.reason, "detail": r.detail}
            for r in found
        ]  # fmt: skip
        if args.json:
            print(json.dumps(rows, indent=2))
            return 0
        print(f"{'AT (UTC)':20} {'DEVICE':18} {'JOB':18} {'ROUND':>5} {'REASON':10} DETAIL")
        for r in rows:
            at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(r["at"]))
            print(
                f"{at:20} {r['device_id'][:18]:18} {r['job_id'][:18]:18} {r['round']:>5} "
                f"{r['reason']:10} {r['detail'][:80]}"
            )
        return 0

    return asyncio.run(go())


def _devices_list(args: argparse.Namespace) -> int:
    from flotilla.cli.remote import device_json

    async def go() -> int:
        async with _remote(args) as remote:
            devices = [device_json(d) for d in await remote.devices(args.task, args.job)]
        if args.json:
            print(json.dumps(devices, indent=2))
            return 0
        print(
            f"{'ID':20} {'STATE':10} {'JOB / REASON':28} {'GFLOPS':>8} {'UP MB/s':>8} "
            f"{'SAMPLES':>8} SELECTED"
        )
        for d in devices:
            note = d["job_id"] or d["reason"] or ""
            picks = sum(d["selected"].values())
            held = str(sum(d["samples"].values())) if d["samples"] else "-"
            print(
                f"{d['id']:20} {d['state']:10} {note[:28]:28} {d['gflops']:8.1f} "
                f"{d['upload_bytes_per_s'] / 1e6:8.1f} {held:>8} {picks}"
            )
        return 0

    return asyncio.run(go())


def _tls_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tls-ca", type=Path, default=None)
    p.add_argument(
        "--tls-cert", type=Path, default=None,
        help="the operator's client certificate, for a server with --tls-client-ca",
    )  # fmt: skip
    p.add_argument("--tls-key", type=Path, default=None, help="its private key")


def _remote(args: argparse.Namespace) -> RemoteServer:
    from flotilla.cli.remote import RemoteServer

    return RemoteServer.of(
        args.server, args.state_dir, args.token, args.tls_ca, args.tls_cert, args.tls_key
    )


def _job_submit(args: argparse.Namespace) -> int:
    from flotilla.core.jobfile import load_job_specs

    specs = load_job_specs(args.spec, args.set)
    if args.job is not None:
        specs = tuple(s for s in specs if s.job.name == args.job)
        if not specs:
            raise SpecError(f"{args.spec}: no job named {args.job!r}")

    async def go() -> int:
        from flotilla.cli.remote import job_json

        ids, infos = [], []
        async with _remote(args) as remote:
            for spec in specs:
                info = await remote.submit(spec)
                if not args.json:
                    print(f"submitted {info.name}")
                ids.append(info.id)
                infos.append(job_json(info))
        print(json.dumps(infos, indent=2) if args.json else "\n".join(ids))
        return 0

    return asyncio.run(go())


def _job_list(args: argparse.Namespace) -> int:
    from flotilla.cli.remote import job_json

    async def go() -> int:
        async with _remote(args) as remote:
            jobs = [job_json(j) for j in await remote.jobs()]
        if args.json:
            print(json.dumps(jobs, indent=2))
            return 0
        print(f"{'ID':16} {'NAME':16} {'STATE':10} {'ROUNDS':>9} {'ACCURACY':>9}")
        for j in jobs:
            acc = j["metrics"].get("accuracy")
            rounds = f"{j['rounds_committed']}/{j['rounds_total']}"
            acc_text = f"{acc:.4f}" if acc is not None else "-"
            print(f"{j['id']:16} {j['name'][:16]:16} {j['state']:10} {rounds:>9} {acc_text:>9}")
        return 0

    return asyncio.run(go())


def _job_status(args: argparse.Namespace) -> int:
    from flotilla.cli.remote import job_json

    if args.watch:
        return _job_watch(args)

    async def go() -> int:
        async with _remote(args) as remote:
            info = job_json(await remote.job(args.job_id, args.rounds), args.rounds)
        if args.json:
            print(json.dumps(info, indent=2))
            return 0
        print(f"{info['id']}  {info['name']}  {info['state']}")
        print(f"rounds {info['rounds_committed']}/{info['rounds_total']}  task {info['task']}")
        for key, value in sorted(info["metrics"].items()):
            print(f"  {key:12} {value:.4f}")
        for r in info.get("rounds", []):
            metrics = " ".join(f"{k}={v:.4f}" for k, v in sorted(r["metrics"].items()))
            print(f"  round {r['round']:>4}  {len(r['participants'])} devices  {metrics}")
        return 0

    return asyncio.run(go())


def _job_watch(args: argparse.Namespace) -> int:
    from flotilla.cli.watch import watch

    if args.rounds:
        raise SpecError("--watch shows the latest round; drop --rounds")
    if not args.interval > 0:
        raise SpecError(f"--interval must be > 0, got {args.interval}")

    async def go() -> int:
        async with _remote(args) as remote:
            return await watch(remote, args.job_id, args.interval, args.json)

    return asyncio.run(go())


def _job_cancel(args: argparse.Namespace) -> int:
    from flotilla.cli.remote import job_json

    async def go() -> int:
        async with _remote(args) as remote:
            info = await remote.cancel(args.job_id)
        print(json.dumps(job_json(info), indent=2) if args.json else f"{info.id} {info.state}")
        return 0

    return asyncio.run(go())


def _job_plot(args: argparse.Namespace) -> int:
    from flotilla.cli.plot import plot_job

    async def go() -> int:
        async with _remote(args) as remote:
            written = await plot_job(remote, args.job_id, args.out)
        print("\n".join(str(path) for path in written))
        return 0

    return asyncio.run(go())


def _job_export(args: argparse.Namespace) -> int:
    if args.format == "executorch":
        from flotilla.cli.export import export_executorch

        return export_executorch(args, _remote(args))

    async def go() -> int:
        async with _remote(args) as remote:
            data = await remote.export(args.job_id)
        args.out.write_bytes(data)
        print(f"wrote {len(data)} bytes to {args.out}")
        return 0

    return asyncio.run(go())
