"""The impaired-network helper really delays, drops and throttles traffic between namespaces.

Every measurement is real traffic between two host namespaces through the user-space forwarder;
bounds are wide because the machine is shared with CPU-heavy work.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import pytest

from tests.support.lifetime import bound
from tests.support.netimpair import PREFIX, Impairment, Network, impaired_network

PORT = 9000

ECHO = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
while True:
    data, addr = s.recvfrom(65536)
    s.sendto(data, addr)
"""

PING = """
import json, socket, sys, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.settimeout(1.5)
rtts = []
for i in range(count):
    tag = str(i).encode()
    t0 = time.monotonic()
    s.sendto(tag, (host, port))
    try:
        while s.recvfrom(64)[0] != tag:
            pass
    except TimeoutError:
        continue
    rtts.append((time.monotonic() - t0) * 1000.0)
    time.sleep(0.01)
print(json.dumps(rtts))
"""

TCP_SINK = """
import json, socket, sys, time
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", int(sys.argv[1])))
srv.listen(1)
srv.settimeout(20)
print("ready", flush=True)
conn, _ = srv.accept()
conn.settimeout(20)
buf = bytearray(1 << 20)
total, first, last = 0, None, None
while True:
    n = conn.recv_into(buf)
    if not n:
        break
    last = time.monotonic()
    if first is None:
        first = last
    total += n
conn.close()
print(json.dumps({"bytes": total, "seconds": last - first}))
"""

TCP_SOURCE = """
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.create_connection((host, port), timeout=10)
chunk = bytes(65536)
end = time.monotonic() + seconds
while time.monotonic() < end:
    s.sendall(chunk)
s.shutdown(socket.SHUT_WR)
s.settimeout(20)
s.recv(1)
"""

UDP_SINK = """
import json, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.settimeout(10)
print("ready", flush=True)
seen = set()
while True:
    try:
        data = s.recv(2048)
    except TimeoutError:
        break
    seen.add(int(data[:8]))
    s.settimeout(1.0)
print(json.dumps({"received": len(seen)}))
"""

UDP_SOURCE = """
import socket, sys, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(count):
    s.sendto(f"{i:08d}".encode().ljust(200, b"."), (host, port))
    if i % 10 == 9:
        time.sleep(0.005)
"""


def start_server(net: Network, host: int, code: str, *args: str) -> subprocess.Popen[bytes]:
    """Start a script in ``host``; wait (bounded) for its "ready" line so clients never race it."""
    proc = net.python(host, code, *args, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None
    fd, line, deadline = proc.stdout.fileno(), b"", time.monotonic() + 15
    while not line.endswith(b"\n"):
        assert time.monotonic() < deadline, "server did not start"
        os.set_blocking(fd, False)
        try:
            byte = os.read(fd, 1)
        except BlockingIOError:
            time.sleep(0.01)
            continue
        assert byte, f"server exited: {proc.communicate(timeout=5)[1].decode()}"
        line += byte
    os.set_blocking(fd, True)
    assert line == b"ready\n"
    return proc


def run_json(net: Network, host: int, code: str, *args: str, timeout: float = 30) -> Any:
    """Run a client script in ``host`` and parse the JSON it prints."""
    done = net.run(host, [sys.executable, "-c", code, *args], timeout=timeout, check=True)
    return json.loads(done.stdout)


def finish_json(proc: subprocess.Popen[bytes], timeout: float = 30) -> Any:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err.decode()
    return json.loads(out)


def ping(net: Network, src: int, dst: int, count: int) -> list[float]:
    """Round-trip times in ms of ``count`` UDP probes (lost ones left out)."""
    rtts: list[float] = run_json(net, src, PING, net.ip(dst), str(PORT), str(count))
    return rtts


def tcp_mbit(net: Network, seconds: float) -> float:
    """Goodput in Mbit/s of one TCP bulk transfer from host 0 to host 1, seen by the receiver."""
    sink = start_server(net, 1, TCP_SINK, str(PORT + 1))
    net.run(
        0,
        [sys.executable, "-c", TCP_SOURCE, net.ip(1), str(PORT + 1), str(seconds)],
        timeout=seconds + 30,
        check=True,
    )
    result = finish_json(sink)
    assert result["bytes"] > 0
    return float(result["bytes"] * 8 / result["seconds"] / 1e6)


def namespaces() -> set[str]:
    out = subprocess.run(
        bound(["ip", "netns", "list"]),
        capture_output=True,
        text=True,
        timeout=10,
    )
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("delay", "jitter", "low", "high"),
    [(0, 0, 0, 25), (100, 0, 190, 320), (50, 20, 70, 200)],
)
def test_rtt_is_twice_the_delay(delay: float, jitter: float, low: float, high: float) -> None:
    """A UDP echo across the link takes the delay once each way (plus jitter when asked)."""
    with impaired_network(2, delay_ms=delay, jitter_ms=jitter, seed=1) as net:
        start_server(net, 1, ECHO, str(PORT))
        rtts = ping(net, 0, 1, 15)
        assert len(rtts) == 15, "no loss configured, every probe must come back"
        median = statistics.median(rtts)
        print(f"delay={delay} jitter={jitter}: median RTT {median:.1f} ms, {sorted(rtts)}")
        assert low <= median <= high
        assert min(rtts) >= 2 * max(0.0, delay - jitter) - 1
        if jitter:
            assert max(rtts) - min(rtts) > 10, "jitter must spread the RTTs"


@pytest.mark.timeout(60)
def test_rate_cap_limits_tcp_throughput() -> None:
    """A 20 Mbit/s cap holds a TCP bulk transfer to ~20 Mbit/s; without it, it is much faster."""
    with impaired_network(2, delay_ms=10, rate_mbit=20) as net:
        capped = tcp_mbit(net, 3.0)
        stats = net.stats()["total"]
    with impaired_network(2, delay_ms=10) as net:
        free = tcp_mbit(net, 2.0)
    print(f"capped {capped:.1f} Mbit/s, uncapped {free:.1f} Mbit/s, capped stats {stats}")
    assert 10 <= capped <= 22
    assert free >= 2 * capped


@pytest.mark.timeout(60)
def test_random_loss_drops_about_the_given_fraction() -> None:
    """With loss=0.05 about 5 % of 2,000 UDP datagrams never arrive."""
    sent = 2000
    with impaired_network(2, loss=0.05, seed=7) as net:
        sink = start_server(net, 1, UDP_SINK, str(PORT))
        net.run(
            0,
            [sys.executable, "-c", UDP_SOURCE, net.ip(1), str(PORT), str(sent)],
            timeout=30,
            check=True,
        )
        received = finish_json(sink)["received"]
        lost = net.stats()["total"]["lost"]
    print(f"received {received}/{sent}, forwarder dropped {lost}")
    assert 0.02 <= (sent - received) / sent <= 0.10
    assert 0.02 <= lost / sent <= 0.10
    assert received <= sent - lost


@pytest.mark.timeout(60)
def test_set_impairment_partitions_one_host() -> None:
    """Changing one sender's queue at run time cuts only that host off, and it can be undone."""
    with impaired_network(3) as net:
        start_server(net, 2, ECHO, str(PORT))
        assert len(ping(net, 0, 2, 3)) == 3
        net.set_impairment(Impairment(loss=1.0), src=0)
        assert ping(net, 0, 2, 2) == []
        assert len(ping(net, 1, 2, 3)) == 3
        net.set_impairment(Impairment())
        assert len(ping(net, 0, 2, 3)) == 3
        assert net.stats()["total"]["lost"] >= 2


def _check_gone(prefix: str, forwarder_pid: int | None, procs: list[subprocess.Popen[Any]]) -> None:
    assert not {n for n in namespaces() if n.startswith(prefix)}
    assert forwarder_pid is not None and not alive(forwarder_pid)
    for proc in procs:
        assert proc.poll() is not None


@pytest.mark.timeout(60)
def test_cleanup_on_normal_exit_and_on_exception() -> None:
    """Namespaces, forwarder and host processes are gone after the block, even when it raises."""
    with impaired_network(2) as net:
        sleeper = net.popen(0, ["sleep", "60"])
        assert {h.netns for h in net.hosts} <= namespaces()
        assert net.forwarder_pid is not None and alive(net.forwarder_pid)
    _check_gone(net.prefix, net.forwarder_pid, [sleeper])

    for error in (RuntimeError, KeyboardInterrupt):  # a failure, and Ctrl-C / an interrupt
        with pytest.raises(error, match="boom"), impaired_network(2) as net:
            sleeper = net.popen(1, ["sleep", "60"])
            raise error("boom")
        _check_gone(net.prefix, net.forwarder_pid, [sleeper])


def _wait_until_inside(netns: str, pid: int, within: float = 10.0) -> None:
    """Wait for ``pid`` to have entered ``netns``: ``ip netns exec`` takes a moment to
    start, and a sweep before that finds the namespace empty."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        listed = subprocess.run(
            bound(["ip", "netns", "pids", netns]), capture_output=True, text=True, timeout=10
        )
        if str(pid) in listed.stdout.split():
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} never entered {netns}")


@pytest.mark.timeout(60)
def test_stale_namespaces_of_dead_runs_are_swept() -> None:
    """A namespace left by a dead creator is deleted (its processes killed); a live one is kept."""
    dead = subprocess.Popen(bound(["true"]))
    dead.wait(timeout=10)
    live = subprocess.Popen(bound(["sleep", "60"]))
    stale_ns, live_ns = f"{PREFIX}{dead.pid}-000000-h0", f"{PREFIX}{live.pid}-000000-h0"
    leftover = None
    try:
        for name in (stale_ns, live_ns):
            subprocess.run(bound(["ip", "netns", "add", name]), check=True, timeout=10)
        leftover = subprocess.Popen(
            bound(["ip", "netns", "exec", stale_ns, "sleep", "60"]),
            start_new_session=True,
        )
        _wait_until_inside(stale_ns, leftover.pid)
        with impaired_network(1):
            assert stale_ns not in namespaces()
            assert live_ns in namespaces()
        assert leftover.wait(timeout=10) == -signal.SIGKILL
    finally:
        for name in (stale_ns, live_ns):
            subprocess.run(
                bound(["ip", "netns", "del", name]),
                capture_output=True,
                timeout=10,
            )
        for proc in (leftover, live):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
