"""``flotilla volunteer``: join a run, ``coordinate`` one, or read its ``status``.

Kept apart from :mod:`flotilla.cli` so that hivemind is imported only by these commands.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flotilla.core.errors import NotFoundError

if TYPE_CHECKING:
    from flotilla.core.lifetime import StopEvent
    from flotilla.p2p import Coordinator, RunStatus


def add_volunteer_parser(commands: Any) -> None:
    vol = commands.add_parser(
        "volunteer",
        help="join a volunteer training run (or coordinate one, or read its status)",
        description="Join a volunteer run and train until stopped. Subcommands: "
        "'coordinate' starts a run, 'status' reads one.",
    )
    _run_options(vol, required=False)
    vol.add_argument("--initial-peers", nargs="+", default=None, metavar="MADDR")
    vol.add_argument("--batch-size", type=int, default=None, help="samples per local step")
    vol.add_argument("--client-mode", action="store_true", help="no incoming connections")
    vol.add_argument("--auxiliary", action="store_true", help="assist averaging without training")
    vol.add_argument("--coordinator-key", default=None, help="trust only this coordinator")
    vol.add_argument("--max-epochs", type=int, default=None, help="stop after N run epochs")
    vol.set_defaults(handler=_join)
    sub = vol.add_subparsers(title="volunteer commands", metavar="ACTION")

    coord = sub.add_parser("coordinate", help="start a run: bootstrap peer, record, checkpoints")
    _run_options(coord, required=True)
    coord.add_argument("--initial-peers", nargs="+", default=(), metavar="MADDR")
    coord.add_argument("--target-batch-size", type=int, default=1024)
    coord.add_argument("--batch-size", type=int, default=16, help="suggested per local step")
    coord.add_argument("--compression", choices=("none", "fp16", "int8"), default="none")
    coord.add_argument(
        "--averaging",
        choices=("gradients", "state", "gossip"),
        default="gradients",
        help="gossip: each peer mixes parameters with a neighbour per epoch (no group)",
    )
    coord.add_argument(
        "--gossip-topology", choices=("exponential", "ring", "random"), default="exponential"
    )
    coord.add_argument(
        "--gossip-mode",
        choices=("sync", "async"),
        default="sync",
        help="async: shares travel while the next epochs compute (training never waits)",
    )
    coord.add_argument(
        "--delayed-averaging",
        action="store_true",
        help="gradient averaging: average an epoch's gradients while the next computes "
        "(applied one epoch late)",
    )
    coord.add_argument(
        "--gossip-wait", type=float, default=10.0, help="a gossip step's longest wait (s)"
    )
    coord.add_argument("--learning-rate", type=float, default=3e-3)
    coord.add_argument("--matchmaking-time", type=float, default=5.0)
    coord.add_argument("--averaging-timeout", type=float, default=30.0)
    coord.add_argument(
        "--plain-averaging",
        action="store_true",
        help="hivemind's own averaging (lets plain-hivemind peers join; partial averages "
        "possible when a peer dies mid-round)",
    )
    coord.add_argument("--checkpoint-every", type=int, default=1, help="epochs")
    coord.add_argument("--max-seconds", type=float, default=None, help="stop after this long")
    # Set by a server hosting the run: the coordinator stops when the server dies.
    coord.add_argument("--stop-with-parent", action="store_true", help=argparse.SUPPRESS)
    coord.set_defaults(handler=_coordinate)

    runs = sub.add_parser("runs", help="the volunteer runs a federation server coordinates")
    runs.add_argument("--server", default="127.0.0.1:7070", help="HOST:PORT")
    runs.add_argument("--state-dir", type=Path, default=None, help="reads operator.token here")
    runs.add_argument("--token", default=None, help="operator token")
    runs.add_argument("--tls-ca", type=Path, default=None)
    runs.add_argument("--json", action="store_true")
    runs.set_defaults(handler=_runs)

    status = sub.add_parser("status", help="a run's state, read from the DHT")
    status.add_argument("--run", required=True)
    status.add_argument("--initial-peers", nargs="+", required=True, metavar="MADDR")
    status.add_argument("--json", action="store_true")
    status.set_defaults(handler=_status)


def _run_options(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--run", required=required, help="the run's name")
    parser.add_argument("--task", required=required, help="task entry point, package.module:Name")
    parser.add_argument("--state-dir", type=Path, default=None)
    parser.add_argument(
        "--host-maddrs", nargs="+", default=None, metavar="MADDR",
        help="where to listen (default: loopback only, /ip4/127.0.0.1/tcp/0)",
    )  # fmt: skip


def _join(args: argparse.Namespace) -> int:
    missing = [f"--{n}" for n in ("run", "task") if not getattr(args, n)]
    if not args.initial_peers:
        missing.append("--initial-peers")
    if missing:
        print(f"error: flotilla volunteer needs {', '.join(missing)}", file=sys.stderr)
        return 2
    from flotilla.core.lifetime import exit_now, quiet_teardown, stop_on_signals
    from flotilla.p2p import VolunteerOptions, run_volunteer

    options = VolunteerOptions(
        run=args.run,
        initial_peers=args.initial_peers,
        task=args.task,
        batch_size=args.batch_size,
        client_mode=args.client_mode,
        auxiliary=args.auxiliary,
        host_maddrs=args.host_maddrs,
        coordinator_key=args.coordinator_key,
        state_dir=args.state_dir,
        max_epochs=args.max_epochs,
    )

    def ready(peer: str, record: Any) -> None:
        print(f"joined run {record.run} as {peer}", file=sys.stderr, flush=True)

    def trained(report: Any) -> None:  # printed before leaving: a hard stop may end that
        print(
            json.dumps(
                {
                    "peer": report.peer,
                    "first_epoch": report.first_epoch,
                    "last_epoch": report.last_epoch,
                    "steps": report.steps,
                    "samples": report.samples,
                    "averaged_epochs": report.averaged_epochs,
                    "epoch_losses": {str(e): v for e, v in sorted(report.epoch_losses.items())},
                    "epoch_started": {str(e): t for e, t in sorted(report.epoch_started.items())},
                }
            ),
            flush=True,
        )

    stop = stop_on_signals(options.timeouts.swarm_leave_s)
    stop.on_stop(quiet_teardown)
    run_volunteer(options, stop, ready, on_trained=trained)
    if stop.is_set():  # Ctrl-C: peers were told, averagers stopped; hivemind's waits are not
        exit_now(130)
    return 0


def _coordinate(args: argparse.Namespace) -> int:
    from flotilla.core.lifetime import end_with_parent, quiet_teardown, stop_on_signals
    from flotilla.core.timeouts import Timeouts
    from flotilla.p2p import Coordinator, CoordinatorOptions

    state_dir = args.state_dir or Path.cwd() / f"flotilla-run-{args.run}"
    record = {
        "target_batch_size": args.target_batch_size,
        "batch_size": args.batch_size,
        "compression": args.compression,
        "averaging": args.averaging,
        "learning_rate": args.learning_rate,
        "matchmaking_time": args.matchmaking_time,
        "averaging_timeout": args.averaging_timeout,
        "verified_averaging": not args.plain_averaging,
        "gossip_topology": args.gossip_topology,
        "gossip_mode": args.gossip_mode,
        "gossip_wait": args.gossip_wait,
        "delayed_averaging": args.delayed_averaging,
    }
    coordinator = Coordinator(
        CoordinatorOptions(
            run=args.run,
            task=args.task,
            state_dir=state_dir,
            host_maddrs=args.host_maddrs,
            initial_peers=args.initial_peers,
            checkpoint_every=args.checkpoint_every,
            record=record,
        )
    )
    if args.stop_with_parent:
        end_with_parent()
    stop = stop_on_signals(Timeouts().swarm_leave_s)
    stop.on_stop(quiet_teardown)
    try:
        for maddr in coordinator.start():
            print(maddr, flush=True)
        print(f"coordinator key: {coordinator.public_key}", file=sys.stderr, flush=True)
        if args.max_seconds is not None:
            threading.Timer(args.max_seconds, stop.set).start()
        last = [0.0]

        def show(status: Any) -> None:
            if time.monotonic() - last[0] >= 5.0:
                last[0] = time.monotonic()
                loss = "-" if status.loss is None else f"{status.loss:.3f}"
                print(
                    f"epoch {status.epoch} | peers {status.peers_online} | "
                    f"{status.samples_per_second:.1f} samples/s | loss {loss} | "
                    f"checkpoint {status.checkpoint_epoch}",
                    file=sys.stderr,
                    flush=True,
                )

        _serve_until_stopped(coordinator, stop, show)
    finally:
        coordinator.shutdown()
    return 0


def _serve_until_stopped(
    coordinator: Coordinator, stop: StopEvent, show: Callable[[RunStatus], None]
) -> None:
    """Serve on a thread of its own, so that the main thread only waits, in short slices.
    Python runs a signal's handler in the main thread, and only when that thread wakes: one
    blocked in a duty (a checkpoint's download waits up to the record's
    ``load_state_timeout``) would leave Ctrl-C unanswered, and the hard stop unarmed, until
    the duty ended. A duty still running when the stop comes gets a moment to end; then
    the coordinator shuts down under it (it fails, and says so in a warning)."""
    from flotilla.core.lifetime import WAKE_EVERY_S
    from flotilla.core.timeouts import Timeouts

    failed: list[BaseException] = []

    def serve() -> None:
        try:
            coordinator.serve(stop, show)
        except BaseException as exc:  # raised again in the main thread, as if it served there
            failed.append(exc)

    serving = threading.Thread(target=serve, name="coordinator", daemon=True)
    serving.start()
    while serving.is_alive() and not stop.is_set():
        stop.wait(WAKE_EVERY_S)
    serving.join(timeout=Timeouts().coordinator_stop_s)
    if failed:
        raise failed[0]


def _runs(args: argparse.Namespace) -> int:
    import asyncio

    from flotilla.cli.remote import RemoteServer

    async def go() -> list[dict[str, Any]]:
        async with RemoteServer.of(args.server, args.state_dir, args.token, args.tls_ca) as remote:
            return [
                {
                    "run": r.run,
                    "task": r.task,
                    "maddrs": list(r.maddrs),
                    "coordinator_key": r.coordinator_key,
                    "status": json.loads(r.status_json) if r.status_json else None,
                }
                for r in await remote.volunteer_runs()
            ]

    runs = asyncio.run(go())
    if args.json:
        print(json.dumps(runs, indent=2))
        return 0
    for run in runs:
        status = run["status"] or {}
        print(
            f"{run['run']:16} {run['task']:40} epoch {status.get('epoch', '-')} "
            f"peers {status.get('peers_online', '-')} join: {run['maddrs'][0]}"
        )
    return 0


def _status(args: argparse.Namespace) -> int:
    from flotilla.p2p import read_status, start_dht
    from flotilla.p2p.dht import training_peers
    from flotilla.p2p.record import swarm_name

    dht = start_dht(args.initial_peers, client_mode=True)
    try:
        status = read_status(dht, args.run)
        # Those of a verified run's swarm, and plain hivemind peers training under its name.
        peers = training_peers(dht, swarm_name(args.run, True)) | training_peers(dht, args.run)
    finally:
        dht.shutdown()
    if status is None:
        raise NotFoundError(
            f"no status for run {args.run!r} in the DHT (no coordinator, or a wrong name)"
        )
    data = dataclasses.asdict(status)
    data["hivemind_peers"] = len(peers)
    if args.json:
        print(json.dumps(data))
    else:
        loss = "-" if status.loss is None else f"{status.loss:.4f}"
        print(
            f"run {status.run}: epoch {status.epoch}, {status.peers_online} peers online, "
            f"{status.samples_per_second:.1f} samples/s, loss {loss}, "
            f"checkpoint {status.checkpoint_epoch}"
        )
        if status.consensus_distance is not None:
            print(f"  {status.averaging}: consensus distance {status.consensus_distance:.4g}")
        for peer, neighbours in sorted((status.neighbours or {}).items()):
            print(f"  {peer} mixes with {', '.join(neighbours) or 'nobody yet'}")
        for epoch, value in status.loss_history:
            print(f"  epoch {int(epoch)}: loss {value:.4f}")
    return 0
