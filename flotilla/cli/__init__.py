"""``flotilla <command>``: server, client, job, devices, data, demo, simulate, volunteer.

Errors map to exit codes, not tracebacks. Each command imports what it needs when it
runs, so ``flotilla --help`` loads neither grpc nor the database stack.

- ``volunteer``: the ``flotilla volunteer`` commands (hivemind is imported only there).
- ``demo``: ``flotilla demo``, a real local federation.
- ``operator``: the ``job`` and ``devices`` commands.
- ``remote``: :class:`RemoteServer`, the operator's gRPC client the ``job`` and
  ``devices`` commands use, and the JSON shapes they print.
- ``watch``, ``plot``: ``job status --watch`` and ``job plot``.
- ``export``: ``job export --format executorch`` (an on-device training program).
- ``data``: ``flotilla data shard``, a device's shard as a file (for ``flotilla-lite``).
- ``bench``: ``flotilla bench load``, a load run against a fresh server (``loadgen``).
- ``console``: where log lines go (short on the console, details at ``-v`` or in
  ``--log-file``), clear of progress bars.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from flotilla.cli.bench import add_bench_parser
from flotilla.cli.console import setup_logging
from flotilla.cli.data import add_data_parser
from flotilla.cli.limits import rate_limits
from flotilla.cli.operator import add_devices_parser, add_job_parser
from flotilla.cli.tokens import add_token_parser
from flotilla.core.errors import AuthError, FlotillaError, NotFoundError, SpecError, Unreachable
from flotilla.core.timeouts import Timeouts

#: What ``flotilla --help`` says first.
DESCRIPTION = """``flotilla <command>``: server, client, job, devices, data, demo, simulate,
volunteer.

Errors map to exit codes, not tracebacks.
"""

EXIT_CODES: dict[type[FlotillaError], int] = {
    SpecError: 2, AuthError: 3, NotFoundError: 4, Unreachable: 5,
}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        setup_logging(args.verbose, args.log_file, getattr(args, "hushed", ()))
        return handler(args)
    except FlotillaError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return next((c for t, c in EXIT_CODES.items() if isinstance(exc, t)), 1)
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flotilla", description=DESCRIPTION)
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="debug logging: each round's metrics too"
    )
    parser.add_argument(
        "--log-file", type=Path, default=None, metavar="PATH", help="append every detail here"
    )
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _server_parser(commands)
    _client_parser(commands)
    add_job_parser(commands)
    add_devices_parser(commands)
    add_data_parser(commands)
    add_bench_parser(commands)
    demo = commands.add_parser("demo", help="a real local federation: server, 8 agents, 2 jobs")
    demo.add_argument("--agents", type=int, default=8)
    demo.add_argument("--rounds", type=int, default=20)
    demo.add_argument("--jobs", type=int, default=2)
    demo.add_argument("--state-dir", type=Path, default=None, help="keep state here")
    demo.add_argument("--json", action="store_true", help="print the results as JSON")
    demo.add_argument("--keep-serving", action="store_true", help="serve until Ctrl-C at the end")
    # The progress bars show each round: the engine's line per round goes to --log-file.
    demo.set_defaults(handler=_demo, hushed=("flotilla.engine",))
    _simulate_parser(commands)
    _dashboard_parser(commands)
    from flotilla.cli.volunteer import add_volunteer_parser

    add_volunteer_parser(commands)
    return parser


# --- simulate --------------------------------------------------------------------------


def _simulate_parser(commands: Any) -> None:
    sim = commands.add_parser(
        "simulate", help="run an experiment on thousands of virtual clients (simulated time)"
    )
    sim.add_argument("experiment", type=Path, help="experiment TOML: a job spec + [population]")
    sim.add_argument(
        "--clients",
        type=int,
        default=None,
        help="virtual devices in the population (overrides population.clients); at least "
        "every job's clients_per_round, of which each round selects clients_per_round x "
        "over_selection and commits at min_quorum",
    )
    sim.add_argument("--seed", type=int, default=None, help="simulation seed (overrides)")
    sim.add_argument("--out", type=Path, default=Path("sim-out"), help="output directory")
    sim.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    sim.add_argument(
        "--devices", default="cpu", help="where clients train: cpu, or cuda:0,cuda:1,..."
    )
    sim.add_argument("--backend", choices=("local", "ray"), default="local")
    sim.add_argument("--json", action="store_true", help="print summary.json to stdout")
    sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    sim.add_argument("--no-plots", action="store_true", help="no PNG charts at the end")
    sim.set_defaults(handler=_simulate, hushed=("flotilla.engine",))


def _simulate(args: argparse.Namespace) -> int:
    from flotilla.simulation import load_experiment, run_experiment
    from flotilla.simulation.runner import format_duration

    experiment = load_experiment(args.experiment, args.set, args.clients, args.seed)
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    # SIGTERM and SIGINT both raise KeyboardInterrupt wherever the run is, by one handler
    # of ours: the exception unwinds it, so its workers close and its scratch directory is
    # removed (main maps it to exit code 130).
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        summary = run_experiment(
            experiment,
            args.out,
            devices=devices,
            backend=args.backend,
            progress=not args.no_progress,
            plots=not args.no_plots,
        )
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if args.json:
        print(json.dumps(summary, indent=2, sort_keys=True))
    else:
        for name, job in summary["jobs"].items():
            metrics = job["final_metrics"]
            accuracy = metrics.get("accuracy")
            shown = "n/a" if accuracy is None else f"{accuracy:.3f}"
            print(
                f"{name}: {job['state']}, {job['rounds']} rounds, accuracy {shown}, "
                f"{format_duration(job['simulated_seconds'])} simulated"
            )
        print(f"wall time {summary['wall_seconds']:.1f}s; results in {args.out}")
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _dashboard_parser(commands: Any) -> None:
    from flotilla.cli.dashboard import add_dashboard_parser

    add_dashboard_parser(commands)
    commands.choices["dashboard"].set_defaults(handler=_dashboard)


def _dashboard(args: argparse.Namespace) -> int:
    from flotilla.cli.dashboard import serve_dashboard

    return _run(serve_dashboard(args))


def _run(coro: Coroutine[Any, Any, int]) -> int:
    """Run until done or SIGINT/SIGTERM, which cancel the main task so it can clean up."""

    async def wrapper() -> int:
        task = asyncio.ensure_future(coro)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        try:
            return await task
        except asyncio.CancelledError:
            return 0

    return asyncio.run(wrapper())


# --- server ----------------------------------------------------------------------------


def _server_parser(commands: Any) -> None:
    server = commands.add_parser("server", help="run a federation server")
    server.add_argument("--host", default="127.0.0.1")
    server.add_argument("--port", type=int, default=7070, help="0 picks a free port")
    server.add_argument("--state-dir", type=Path, default=Path("flotilla-state"))
    server.add_argument("--db", default=None, help="database URL (default: SQLite in state dir)")
    server.add_argument("--tls-cert", type=Path, default=None)
    server.add_argument("--tls-key", type=Path, default=None)
    server.add_argument(
        "--tls-client-ca", type=Path, default=None, metavar="CA.pem",
        help="mutual TLS: devices (and gRPC operators) present a certificate this CA signed; "
        "a device's names its device id (needs --tls-cert and --tls-key)",
    )  # fmt: skip
    server.add_argument(
        "--rate-limit", action="append", default=[], metavar="KIND=RATE/BURST",
        help="per-device poll or upload, per-address enrol: calls per second and burst "
        "(defaults poll=10/50, upload=10/50, enrol=20/200); repeatable",
    )  # fmt: skip
    server.add_argument(
        "--max-connections", type=int, default=None, metavar="N",
        help="connections (HTTP) and calls in flight (gRPC) per client address (default 256)",
    )  # fmt: skip
    server.add_argument(
        "--liveness", type=float, default=30.0, help="seconds before a silent device is dropped"
    )
    server.add_argument(
        "--lease", type=float, default=Timeouts().job_lease_s, metavar="SECONDS",
        help="each job's lease: several servers on one --db and --state-dir form one "
        "deployment and share the jobs; another takes a job over within 5/3 of this after "
        "the server running it dies",
    )  # fmt: skip
    server.add_argument(
        "--poll-hold", type=float, default=Timeouts().poll_hold_s, metavar="SECONDS",
        help="how long a device's poll waits for work before it is answered empty (default "
        "%(default)s; at most half of --liveness): shorter behind proxies that cut idle "
        "requests",
    )  # fmt: skip
    server.add_argument(
        "--volunteer-run",
        "--p2p",
        dest="volunteer_run",
        action="append",
        default=[],
        metavar="NAME=TASK",
        help="coordinate a volunteer run (the p2p extra); repeatable",
    )
    server.add_argument(
        "--p2p-host-maddrs", nargs="+", default=None, metavar="MADDR",
        help="where volunteer peers and devices of p2p rounds reach the server's hivemind "
        "peers (default: loopback only)",
    )  # fmt: skip
    server.add_argument(
        "--p2p-announce-maddrs", nargs="+", default=None, metavar="MADDR",
        help="the addresses those peers announce (behind NAT or a proxy)",
    )  # fmt: skip
    http = server.add_mutually_exclusive_group()
    http.add_argument(
        "--http-port", type=int, default=7071,
        help="the HTTP API, /metrics and the dashboard (default 7071; 0 picks a free port)",
    )  # fmt: skip
    http.add_argument("--no-http", action="store_true", help="no HTTP API or dashboard")
    server.add_argument("--http-host", default=None, help="default: the --host")
    server.set_defaults(handler=_serve)
    sub = server.add_subparsers(title="server commands", metavar="SUBCOMMAND")
    add_token_parser(sub)


def _serve(args: argparse.Namespace) -> int:
    from flotilla.server.app import FederationServer, ServerConfig
    from flotilla.server.process import single_threaded_blas

    if bool(args.tls_cert) != bool(args.tls_key):
        raise SpecError("--tls-cert and --tls-key go together")
    if not args.poll_hold >= 0:
        raise SpecError(f"--poll-hold must be 0 or more seconds, got {args.poll_hold}")
    if not args.lease > 0:
        raise SpecError(f"--lease must be more than 0 seconds, got {args.lease}")
    from flotilla.server.hosting.volunteers import VolunteerRunSpec

    single_threaded_blas()
    config = ServerConfig(
        volunteer_runs=tuple(VolunteerRunSpec.parse(v) for v in args.volunteer_run),
        p2p_host_maddrs=tuple(args.p2p_host_maddrs) if args.p2p_host_maddrs else None,
        p2p_announce_maddrs=(tuple(args.p2p_announce_maddrs) if args.p2p_announce_maddrs else None),
        host=args.host,
        port=args.port,
        state_dir=args.state_dir,
        db_url=args.db,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        tls_client_ca=args.tls_client_ca,
        rate_limits=rate_limits(args.rate_limit, args.max_connections),
        timeouts=Timeouts(
            liveness_s=args.liveness, poll_hold_s=args.poll_hold, job_lease_s=args.lease
        ),
        http_port=None if args.no_http else args.http_port,
        http_host=args.http_host,
    )

    async def serve() -> int:
        server = FederationServer(config)
        port = await server.start()
        if server.dashboard_url:  # before "listening on", which scripts wait for
            print(f"dashboard: {server.dashboard_url}", flush=True)
        print(f"flotilla server listening on {args.host}:{port}", flush=True)
        for run in server.volunteers.infos():
            print(f"volunteer run {run.run}: {' '.join(run.maddrs)}", flush=True)
        try:
            await server.wait()
        finally:
            await server.stop()
        return 0

    return _run(serve())


# --- client ----------------------------------------------------------------------------


def _client_parser(commands: Any) -> None:
    client = commands.add_parser("client", help="run a client agent on this device")
    client.add_argument(
        "--server", required=True,
        help="HOST:PORT; several servers of one deployment, comma-separated, are tried in turn",
    )  # fmt: skip
    client.add_argument("--token", required=True, help="enrolment token")
    client.add_argument("--task", required=True, help="task entry point, package.module:Name")
    client.add_argument("--shard", default="0/1", help="this device's shard, i/N")
    client.add_argument(
        "--data", type=Path, default=None, help="local data (tasks that read files)"
    )
    client.add_argument("--state-dir", type=Path, default=None, help="keeps the credential")
    client.add_argument("--tls-ca", type=Path, default=None)
    client.add_argument(
        "--tls-cert", type=Path, default=None,
        help="this device's certificate, for a server with --tls-client-ca (its CN: the device id)",
    )  # fmt: skip
    client.add_argument("--tls-key", type=Path, default=None, help="its private key")
    client.add_argument(
        "--conditions", type=Path, default=None, metavar="FILE",
        help="JSON object (charging, battery 0..1, network, idle, thermal) re-read at every "
        "poll and heartbeat; without it, power and battery as the OS reports them",
    )  # fmt: skip
    client.add_argument(
        "--device-class", default="", help="what kind of device this is (phone, sbc, laptop...)"
    )
    p2p = client.add_argument_group("server-less rounds (jobs with transport p2p; p2p extra)")
    p2p.add_argument(
        "--p2p-host-maddrs", nargs="+", default=None, metavar="MADDR",
        help="where this device's hivemind peer listens (default: loopback only)",
    )  # fmt: skip
    p2p.add_argument("--p2p-announce-maddrs", nargs="+", default=None, metavar="MADDR")
    p2p.add_argument(
        "--p2p-client-mode", action="store_true",
        help="accept no incoming connections (behind NAT); others must reduce for it",
    )  # fmt: skip
    client.set_defaults(handler=_client)


def _client(args: argparse.Namespace) -> int:
    from flotilla.client import Agent, AgentConfig, LocalTrainer
    from flotilla.client.conditions import conditions_source
    from flotilla.core.allreduce import PeerOptions
    from flotilla.tasks import Shard, ShardTraining, load_task

    try:
        shard = Shard.parse(args.shard)
    except ValueError as exc:
        raise SpecError(f"--shard: {exc}") from exc
    if bool(args.tls_cert) != bool(args.tls_key):
        raise SpecError("--tls-cert and --tls-key go together")
    if args.tls_cert and not args.tls_ca:
        raise SpecError("--tls-cert is for a TLS server: give --tls-ca too")
    load_task(args.task)  # fail now, not at the first round
    try:
        conditions = conditions_source(args.conditions)  # a bad file fails now too
    except FlotillaError as exc:
        raise SpecError(f"--conditions: {exc}") from exc
    trainer = LocalTrainer(ShardTraining(args.task, shard, args.data), state_dir=args.state_dir)
    config = AgentConfig(
        server=args.server,
        token=args.token,
        trainer=trainer,
        state_dir=args.state_dir,
        tls_ca=args.tls_ca,
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        p2p=PeerOptions(
            host_maddrs=tuple(args.p2p_host_maddrs) if args.p2p_host_maddrs else None,
            announce_maddrs=tuple(args.p2p_announce_maddrs) if args.p2p_announce_maddrs else None,
            client_mode=args.p2p_client_mode,
            identity_path=args.state_dir / "p2p-identity.key" if args.state_dir else None,
        ),
        conditions=conditions,
        device_class=args.device_class,
    )

    async def run() -> int:
        await Agent(config).run()
        return 0

    return _run(run())


def _demo(args: argparse.Namespace) -> int:
    from flotilla.cli.demo import run_demo

    return run_demo(
        args.agents, args.rounds, args.jobs, args.state_dir, args.json, args.keep_serving
    )


if __name__ == "__main__":
    sys.exit(main())
