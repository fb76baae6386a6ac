"""``flotilla dashboard DIR``: the dashboard a federation server shows, over a simulation's
output directory, so a researcher watches an experiment (while ``flotilla simulate`` still
writes it) the way an operator watches a federation.

Each start mints a random read token and prints the page's address with it in the URL
fragment (the page moves it into the tab's session storage and out of the address bar); the
fragment never reaches the server or its log.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
from pathlib import Path
from typing import Any

from flotilla.core.errors import SpecError

#: ``flotilla server`` serves its dashboard on 7071; a simulation's gets the next port.
DEFAULT_PORT = 7072


def add_dashboard_parser(commands: Any) -> None:
    dash = commands.add_parser(
        "dashboard", help="watch a simulation's output directory in the browser (live)"
    )
    dash.add_argument("dir", type=Path, help="the --out directory of flotilla simulate")
    dash.add_argument("--port", type=int, default=DEFAULT_PORT, help="0 picks a free port")
    dash.add_argument("--host", default="127.0.0.1", help="address to listen on")
    dash.add_argument(
        "--poll", type=float, default=0.5, help="seconds between reads of the growing files"
    )


def url(host: str, port: int, token: str) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/#token={token}"


async def serve_dashboard(args: argparse.Namespace) -> int:
    """Serve until cancelled (Ctrl-C); prints ``dashboard: URL`` once listening."""
    from aiohttp import web

    from flotilla.core.access import Scope
    from flotilla.dashboard.app import build_read_app
    from flotilla.dashboard.guard import SafeAccessLogger, StaticTokens
    from flotilla.dashboard.simulation import SimulationSource

    directory: Path = args.dir
    if directory.exists() and not directory.is_dir():
        raise SpecError(f"{directory} is a file: give the --out directory of flotilla simulate")
    if args.poll <= 0:
        raise SpecError(f"--poll must be > 0, got {args.poll}")
    if not args.verbose:  # one line per request belongs at -v
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    token = secrets.token_urlsafe(24)
    source = SimulationSource(directory, poll_s=args.poll)
    app = build_read_app(source.read_model(), StaticTokens({token: Scope.READ}), "simulation")
    runner = web.AppRunner(app, access_log_class=SafeAccessLogger)
    await runner.setup()
    try:
        site = web.TCPSite(runner, args.host, args.port)
        try:
            await site.start()
        except OSError as exc:
            raise SpecError(
                f"cannot listen on {args.host}:{args.port} ({exc.strerror}): "
                "pick another --port, or --port 0 for a free one"
            ) from exc
        port = int(runner.addresses[0][1])
        if not directory.is_dir():
            print(f"waiting for {directory} (flotilla simulate --out {directory})", flush=True)
        print(f"dashboard: {url(args.host, port, token)}", flush=True)
        await asyncio.Event().wait()  # until Ctrl-C cancels this task
    finally:
        await runner.cleanup()
    return 0
