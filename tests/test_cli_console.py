"""What a person sees on the console: `flotilla demo` and `flotilla simulate` draw clean
progress bars with short log lines above them (each round's metrics dict only at -v or in
--log-file); `job status --watch` follows a job to its end; `job plot` draws it; a failed
call says what to do next.

The demo and the watch run on a pseudo-terminal (tests.support.terminal) and are judged by
the screen they leave, as a person would judge them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from flotilla.cli.console import setup_logging
from flotilla.cli.demo import Served, dashboard_url, next_steps
from flotilla.client import Agent, AgentConfig, LocalTrainer
from flotilla.core.timeouts import Timeouts
from flotilla.report import PLOT_FILES
from flotilla.tasks import Shard, ShardTraining
from tests.support.experiments import experiment_file
from tests.support.live_grpc import DIGITS, LiveServer, live_server, run_cli
from tests.support.processes import flotilla
from tests.support.terminal import render, run_on_terminal

pytestmark = pytest.mark.timeout(180)

#: What a whole per-round metrics dict looks like in a log line.
METRICS_DICT = "metrics: {'"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _flotilla_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "flotilla", *args]


def _bar_lines(screen: list[str], name: str) -> list[int]:
    return [i for i, line in enumerate(screen) if line.startswith(name) and "%|" in line]


def _assert_untorn(screen: list[str]) -> None:
    """No line holds a bar and anything else; no per-round dict reached the console."""
    for line in screen:
        if "%|" in line:
            assert line.count("%|") == 1 and "INFO" not in line and "DEBUG" not in line, line
    assert not any(METRICS_DICT in line for line in screen), "\n".join(screen)
    assert not any("Traceback" in line for line in screen), "\n".join(screen)


# --- the demo ----------------------------------------------------------------------------


@pytest.mark.slow
def test_demo_console_has_one_bar_per_job_then_its_table_next_steps_and_keeps_serving(
    tmp_path: Path,
) -> None:
    log = tmp_path / "demo.log"
    watched: list[subprocess.CompletedProcess[str]] = []

    def watch_as_told(raw: str) -> None:
        """Run the watch command the demo printed for its live server (the job is done)."""
        told = next(line for line in render(raw) if "job status" in line and "--watch" in line)
        watched.append(flotilla(*told.split()[1:], "--json", timeout=60))

    run = run_on_terminal(
        _flotilla_argv(
            "--log-file", str(log), "demo", "--agents", "2", "--rounds", "2", "--keep-serving"
        ),
        timeout=150,
        interrupt_at="until Ctrl-C",
        before_interrupt=watch_as_told,
    )
    screen = run.screen
    shown = "\n".join(screen)
    assert run.returncode == 0, shown  # Ctrl-C is how --keep-serving ends
    bars = [_bar_lines(screen, name) for name in ("digits-a", "digits-b")]
    assert [len(b) for b in bars] == [1, 1], shown  # drawn in place, never repeated
    assert bars[1][0] == bars[0][0] + 1, shown  # each job keeps its line
    assert "2/2" in screen[bars[0][0]] and "2/2" in screen[bars[1][0]], shown
    _assert_untorn(screen)
    assert not any("round 1/2 committed" in line for line in screen), "the bars say it"
    table = screen.index("held-out accuracy per round")
    assert table > bars[1][0]
    assert screen[table + 1].split() == ["round", "digits-a", "digits-b"]
    serving = next(i for i, line in enumerate(screen) if "until Ctrl-C" in line)
    assert screen[serving - 2].startswith("done in") and serving > table, shown
    assert screen[serving - 1].startswith("dashboard: http://127.0.0.1:"), shown
    assert [line.split()[:3] for line in screen[serving + 1 : serving + 3]] == [
        ["flotilla", "job", "status"],
        ["flotilla", "job", "plot"],
    ], shown
    assert [w.returncode for w in watched] == [0], watched
    assert json.loads(watched[0].stdout.splitlines()[-1])["state"] == "completed"
    details = log.read_text()
    assert METRICS_DICT in details and "round 2/2 committed, accuracy" in details


def test_dashboard_url_comes_from_server_json_when_the_server_serves_http(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    state.mkdir()
    assert dashboard_url(state) is None  # no server.json yet
    (state / "server.json").write_text(json.dumps({"host": "127.0.0.1", "port": 7070}))
    assert dashboard_url(state) is None  # a server without the HTTP edge
    (state / "server.json").write_text(json.dumps({"host": "127.0.0.1", "http_port": None}))
    assert dashboard_url(state) is None  # --no-http
    served = {"host": "127.0.0.1", "port": 7070, "http_host": "0.0.0.0", "http_port": 40123}
    (state / "server.json").write_text(json.dumps(served))
    assert dashboard_url(state) == "http://127.0.0.1:40123/"
    steps = next_steps([], True, Served(7070, state, dashboard_url(state)))
    assert steps.splitlines()[0].startswith("dashboard: http://127.0.0.1:40123/ (token: ")
    assert f"--server 127.0.0.1:7070 --state-dir {state}" in steps
    assert "dashboard" not in next_steps([], False, Served(7070, state, None)).splitlines()[0]


# --- simulate ------------------------------------------------------------------------------


@pytest.mark.slow
def test_simulate_draws_a_clean_bar_and_shows_round_metrics_only_at_verbose(
    tmp_path: Path,
) -> None:
    path = experiment_file(tmp_path)
    run = run_on_terminal(_flotilla_argv("simulate", str(path), "--out", str(tmp_path / "a")), 150)
    assert run.returncode == 0, run.raw[-3000:]
    assert len(_bar_lines(run.screen, "small")) == 1, "\n".join(run.screen)
    _assert_untorn(run.screen)
    loud = flotilla("-v", "simulate", str(path), "--out", str(tmp_path / "b"), timeout=150)
    assert METRICS_DICT in loud.stderr and "round 4/4 committed" in loud.stderr
    for name in PLOT_FILES:  # the simulator draws the charts `job plot` draws
        assert (tmp_path / "b" / name).read_bytes().startswith(PNG_SIGNATURE), name


@pytest.fixture
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    ours = logging.getLogger("flotilla")
    saved = root.handlers[:], root.level, ours.level
    yield
    for handler in root.handlers:
        if handler not in saved[0]:
            handler.close()
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    ours.setLevel(saved[2])


@pytest.mark.usefixtures("restore_logging")
def test_console_keeps_short_lines_and_the_log_file_keeps_details(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    log = tmp_path / "details.log"
    setup_logging(False, log, hushed=("flotilla.engine",))
    logging.getLogger("flotilla.server.app").info("listening on 127.0.0.1:1")
    logging.getLogger("flotilla.engine.rounds").info("job j round 1/2 committed")
    logging.getLogger("flotilla.engine.rounds").debug("job j round 1 metrics: {'a': 1.0}")
    logging.getLogger("alembic.runtime").info("setup plugin")
    logging.getLogger("alembic.runtime").warning("a library's warning")
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "INFO flotilla.server.app: listening on 127.0.0.1:1",
        "WARNING alembic.runtime: a library's warning",
    ]
    details = log.read_text()
    for text in ("listening on", "round 1/2 committed", "metrics: {'a'", "setup plugin"):
        assert text in details, text


@pytest.mark.usefixtures("restore_logging")
def test_verbose_console_shows_the_details(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(True, None, hushed=("flotilla.engine",))
    logging.getLogger("flotilla.engine.rounds").debug("job j round 1 metrics: {'a': 1.0}")
    assert "metrics: {'a': 1.0}" in capsys.readouterr().err


def test_the_screen_renderer_replays_redraws() -> None:
    assert render("abc\rxy\n\x1b[Aq") == ["qyc"]
    assert render("one\ntwo\n\x1b[2F\x1b[Jthree\n") == ["three"]


# --- job status --watch, job plot, and errors against a real server ------------------------


@pytest.fixture
async def live_with_agent(tmp_path: Path) -> AsyncIterator[LiveServer]:
    """A real gRPC server in this loop with one real agent training digits on it."""
    async with live_server(tmp_path / "state") as live:
        config = AgentConfig(
            server=f"127.0.0.1:{live.port}",
            token=await live.enrol_token(),
            trainer=LocalTrainer(ShardTraining(DIGITS, Shard(0, 1))),
            state_dir=tmp_path / "agent",
            timeouts=Timeouts(heartbeat_every_s=1.0),
            speed_test_bytes=64 * 1024,
        )
        running = asyncio.ensure_future(Agent(config).run())
        try:
            yield live
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)


def _where(live: LiveServer) -> tuple[str, ...]:
    return ("--server", f"127.0.0.1:{live.port}", "--state-dir", str(live.server.state_dir))


async def test_watch_follows_a_job_to_its_end_and_plot_draws_it(
    live_with_agent: LiveServer, tmp_path: Path
) -> None:
    live = live_with_agent
    job_id = await live.submit()  # 2 rounds, 1 device each
    where = _where(live)
    watch = ("job", "status", job_id, "--watch", "--interval", "0.2", *where)
    on_terminal, as_json = await asyncio.gather(
        asyncio.to_thread(run_on_terminal, _flotilla_argv(*watch), 90),
        run_cli(*watch, "--json", timeout=90),
    )
    screen = on_terminal.screen
    assert on_terminal.returncode == 0, on_terminal.raw[-2000:]
    assert [line.split()[:4] for line in screen] == [
        ["JOB", "NAME", "STATE", "ROUND"],
        [job_id, "quick", "completed", "2/2"],
    ], "\n".join(screen)  # one table, redrawn in place
    assert as_json.returncode == 0, as_json.stderr
    changes = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert changes[-1]["state"] == "completed" and changes[-1]["rounds_committed"] == 2
    assert all(c["id"] == job_id for c in changes)
    seen = [(c["state"], c["rounds_committed"], c["metrics"]) for c in changes]
    assert all(a != b for a, b in itertools.pairwise(seen)), "a line per change only"

    status = await run_cli("job", "status", job_id, "--json", "--rounds", *where)
    rounds = json.loads(status.stdout)["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    assert all(r["bytes_up"] > 0 and r["bytes_down"] > 0 and r["selected"] for r in rounds)

    out = tmp_path / "plots"
    plot = await run_cli("job", "plot", job_id, "--out", str(out), *where, timeout=90)
    assert plot.returncode == 0, plot.stderr
    assert plot.stdout.split() == [str(out / name) for name in PLOT_FILES]
    from matplotlib import image

    for name in PLOT_FILES:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000, name
        height, width = image.imread(out / name).shape[:2]
        assert height > 100 and width > 100, name


async def test_watch_of_a_cancelled_job_exits_1(tmp_path: Path) -> None:
    async with live_server(tmp_path / "state") as live:
        job_id = await live.submit()  # no device: it waits
        cancelled = await run_cli("job", "cancel", job_id, "--json", *_where(live))
        assert json.loads(cancelled.stdout)["state"] == "cancelled", cancelled
        watched = await run_cli("job", "status", job_id, "--watch", *_where(live))
        assert watched.returncode == 1, watched
        assert "cancelled" in watched.stdout


async def test_a_wrong_token_names_the_token_file_or_the_flag(tmp_path: Path) -> None:
    elsewhere = tmp_path / "other-state"
    elsewhere.mkdir()
    (elsewhere / "operator.token").write_text("not-this-servers-token\n")
    async with live_server(tmp_path / "state") as live:
        server = ("--server", f"127.0.0.1:{live.port}")
        from_file = await run_cli("job", "list", *server, "--state-dir", str(elsewhere))
        from_flag = await run_cli("devices", "list", *server, "--token", "WRONG")
    assert from_file.returncode == 3, from_file
    assert str(elsewhere / "operator.token") in from_file.stderr
    assert from_flag.returncode == 3 and "--token" in from_flag.stderr, from_flag
    for result in (from_file, from_flag):
        assert "Traceback" not in result.stderr and "WRONG" not in result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_an_unreachable_server_is_named_with_whether_tls_was_expected(
    tmp_path: Path,
) -> None:
    address = f"127.0.0.1:{_free_port()}"
    plain = await run_cli("job", "list", "--server", address, "--token", "t", timeout=40)
    ca = tmp_path / "ca.pem"
    ca.write_text("")
    tls = await run_cli("job", "list", "--server", address, "--token", "t", "--tls-ca", str(ca))
    assert plain.returncode == 5 and tls.returncode == 5, (plain, tls)
    assert address in plain.stderr and "plaintext" in plain.stderr and "--tls-ca" in plain.stderr
    assert address in tls.stderr and "TLS" in tls.stderr, tls.stderr
    assert "Traceback" not in plain.stderr + tls.stderr
