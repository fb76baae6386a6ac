"""Impaired networks for tests: hosts in separate network namespaces joined by a lossy, slow link.

The kernel here has no ``sch_netem``, so this module does what ``tc netem`` would do in user
space: every host namespace gets a TUN device (renamed ``imp0``, address ``10.77.0.<i+1>/24``)
and one forwarder process in the root namespace reads raw IPv4 packets from all the TUN fds and
writes each one to the destination host's TUN after the configured delay, jitter, random loss
and rate pacing.

Semantics follow netem on each host's egress interface (``shaping="uplink"``, the default):

* every packet a host sends goes through one queue per sending host, so the impairment applies
  once per direction: ``delay_ms=100`` gives an RTT of about 200 ms;
* ``loss`` drops each packet independently before it is queued;
* ``jitter_ms`` adds a uniform offset in ``[-jitter, +jitter]`` to the delay, but a packet never
  leaves before the one queued ahead of it (netem with a rate behaves the same), so TCP sees no
  reordering;
* ``rate_mbit`` paces packets at their IP size (as netem ``rate``), after the delay;
* a queue holds at most ``limit`` packets (netem's default 1000); further packets are dropped.

With ``shaping="pair"`` every ordered pair of hosts has its own queue instead (a full mesh of
point-to-point links, so a host may send ``rate_mbit`` to each peer at once).

Usage::

    with impaired_network(2, delay_ms=100, loss=0.01, rate_mbit=20) as net:
        server = net.popen(1, [sys.executable, "-m", "http.server", "8000"])
        get = f"import urllib.request as u; print(u.urlopen('http://{net.ip(1)}:8000/').status)"
        net.run(0, [sys.executable, "-c", get], timeout=30)
        net.set_impairment(Impairment(loss=1.0), src=0)  # host 0 can no longer send
        print(net.stats()["total"])

Every name carries the prefix ``fltni-<creator pid>-``; namespaces left by a dead creator are
swept the next time a network is created. On exit the processes started in the hosts, the
forwarder and the namespaces are gone, also after an exception or a test timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import select
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Any, Literal

try:
    from tests.support.lifetime import bound
except ModuleNotFoundError:  # run as the forwarder script, beside lifetime.py
    from lifetime import bound  # type: ignore[no-redef]

PREFIX = "fltni-"
SUBNET = "10.77.0"
IFNAME = "imp0"
MAX_HOSTS = 250

_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000

Shaping = Literal["uplink", "pair"]


@dataclass(frozen=True)
class Impairment:
    """What one queue does to the packets through it (netem's knobs)."""

    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss: float = 0.0
    rate_mbit: float | None = None
    limit: int = 1000

    def __post_init__(self) -> None:
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise ValueError("delay_ms and jitter_ms must be >= 0")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError("loss is a probability in [0, 1]")
        if self.rate_mbit is not None and self.rate_mbit <= 0:
            raise ValueError("rate_mbit must be > 0 (None for no cap)")
        if self.limit < 1:
            raise ValueError("limit must be >= 1 packet")


@dataclass(frozen=True)
class Host:
    """One host: its namespace and its address on the impaired link."""

    index: int
    netns: str
    ip: str
    ifname: str = IFNAME


def _ip(*args: str, timeout: float, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip`` with a timeout; raise with its stderr when it fails and ``check``."""
    proc = subprocess.run(
        bound(["ip", *args]),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
    return proc


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _netns_names(timeout: float) -> list[str]:
    out = _ip("netns", "list", timeout=timeout).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_netns_pids(netns: str, timeout: float) -> None:
    """SIGKILL what still runs in one of our namespaces (only our processes can be there)."""
    proc = _ip("netns", "pids", netns, timeout=timeout, check=False)
    for word in proc.stdout.split():
        with contextlib.suppress(ValueError, ProcessLookupError):
            os.kill(int(word), signal.SIGKILL)


def sweep_stale(timeout: float = 10.0) -> list[str]:
    """Delete namespaces whose creating process is dead (an aborted run); return their names.

    Namespaces of a live creator are left alone, so parallel runs never disturb each other.
    """
    removed = []
    for name in _netns_names(timeout):
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX) :].split("-", 1)[0])
        except ValueError:
            continue
        if pid == os.getpid() or _pid_alive(pid):
            continue
        _kill_netns_pids(name, timeout)
        _ip("netns", "del", name, timeout=timeout, check=False)
        removed.append(name)
    return removed


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, struct.pack("16sH", name.encode(), _IFF_TUN | _IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Network:
    """Hosts in their own namespaces behind an impaired link; close() undoes everything."""

    def __init__(
        self,
        hosts: int,
        impairment: Impairment,
        *,
        mtu: int = 1500,
        shaping: Shaping = "uplink",
        seed: int | None = None,
        timeout: float = 10.0,
    ) -> None:
        if not 1 <= hosts <= MAX_HOSTS:
            raise ValueError(f"hosts must be in [1, {MAX_HOSTS}]")
        if shaping not in ("uplink", "pair"):
            raise ValueError("shaping is 'uplink' or 'pair'")
        if not 576 <= mtu <= 65535:
            raise ValueError("mtu must be in [576, 65535]")
        self.timeout = timeout
        self.shaping: Shaping = shaping
        self.prefix = f"{PREFIX}{os.getpid()}-{os.urandom(3).hex()}-"
        self.hosts: tuple[Host, ...] = tuple(
            Host(i, f"{self.prefix}h{i}", f"{SUBNET}.{i + 1}") for i in range(hosts)
        )
        self._procs: list[subprocess.Popen[Any]] = []
        self._created: list[str] = []
        self._forwarder: subprocess.Popen[bytes] | None = None
        self._fwd_log: IO[bytes] | None = None
        self._fwd_buf = b""
        self._closed = False
        try:
            self._start(impairment, mtu, seed)
        except BaseException:
            self.close()
            raise

    # -- setup -------------------------------------------------------------------------------

    def _start(self, impairment: Impairment, mtu: int, seed: int | None) -> None:
        sweep_stale(self.timeout)
        tag = self.prefix.split("-")[2]
        fds: list[int] = []
        try:
            for host in self.hosts:
                _ip("netns", "add", host.netns, timeout=self.timeout)
                self._created.append(host.netns)
                tun = f"ni{tag}{host.index}"
                fds.append(_open_tun(tun))
                _ip("link", "set", "dev", tun, "netns", host.netns, timeout=self.timeout)
                batch = (
                    f"link set dev {tun} name {IFNAME}\n"
                    f"link set dev {IFNAME} mtu {mtu} addrgenmode none\n"
                    f"addr add {host.ip}/24 dev {IFNAME}\n"
                    f"link set dev {IFNAME} up\n"
                    "link set dev lo up\n"
                )
                proc = subprocess.run(
                    bound(["ip", "-n", host.netns, "-batch", "-"]),
                    input=batch,
                    capture_output=True,
                    text=True,
                    timeout=self.timeout,
                )
                if proc.returncode != 0:
                    raise RuntimeError(f"configuring {host.netns} failed: {proc.stderr.strip()}")
            self._fwd_log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close())
            self._forwarder = subprocess.Popen(
                bound([sys.executable, "-u", os.path.abspath(__file__)]),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._fwd_log,
                pass_fds=fds,
                start_new_session=True,
            )
        finally:
            for fd in fds:
                os.close(fd)  # the forwarder holds its own copies; the TUNs live as long as it
        config = {
            "fds": fds,
            "ips": [h.ip for h in self.hosts],
            "shaping": self.shaping,
            "impairment": dataclasses.asdict(impairment),
            "seed": seed,
        }
        self._request(config)

    # -- forwarder control ---------------------------------------------------------------------

    def _request(self, message: dict[str, Any]) -> dict[str, Any]:
        """Send one JSON line to the forwarder and wait (bounded) for its one-line answer."""
        fwd = self._forwarder
        if fwd is None or fwd.stdin is None or fwd.stdout is None:
            raise RuntimeError("forwarder not running")
        try:
            fwd.stdin.write(json.dumps(message).encode() + b"\n")
            fwd.stdin.flush()
        except BrokenPipeError:
            raise RuntimeError(f"forwarder died: {self._forwarder_log()}") from None
        deadline = time.monotonic() + self.timeout
        out_fd = fwd.stdout.fileno()
        while b"\n" not in self._fwd_buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"forwarder did not answer {message.get('op', 'config')!r}")
            ready, _, _ = select.select([out_fd], [], [], left)
            if ready:
                chunk = os.read(out_fd, 65536)
                if not chunk:
                    raise RuntimeError(f"forwarder died: {self._forwarder_log()}")
                self._fwd_buf += chunk
        line, self._fwd_buf = self._fwd_buf.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        if not reply.get("ok"):
            raise RuntimeError(f"forwarder refused {message}: {reply.get('error')}")
        return reply

    def _forwarder_log(self) -> str:
        if self._fwd_log is None:
            return ""
        self._fwd_log.seek(0)
        return self._fwd_log.read()[-4000:].decode(errors="replace")

    @property
    def forwarder_pid(self) -> int | None:
        """Pid of the forwarder process (for tests that check it is gone)."""
        return None if self._forwarder is None else self._forwarder.pid

    def set_impairment(
        self, impairment: Impairment, *, src: int | None = None, dst: int | None = None
    ) -> None:
        """Change the impairment from now on, for all queues or those of ``src``/``dst``.

        In ``uplink`` shaping a queue belongs to its sending host, so only ``src`` may be given.
        Packets already queued keep the timing they were given.
        """
        if self.shaping == "uplink" and dst is not None:
            raise ValueError("with shaping='uplink' queues are per sending host: give src only")
        for index in (src, dst):
            if index is not None and not 0 <= index < len(self.hosts):
                raise IndexError(f"no host {index}")
        self._request(
            {"op": "set", "impairment": dataclasses.asdict(impairment), "src": src, "dst": dst}
        )

    def stats(self) -> dict[str, Any]:
        """Forwarder counters: ``links`` (per queue) and ``total`` (rx, sent, lost, overflow...).

        ``lost`` counts random loss, ``overflow`` drops at a full queue, ``unroutable`` packets
        that were not IPv4 to another host (IPv6, broadcast).
        """
        return self._request({"op": "stats"})["stats"]  # type: ignore[no-any-return]

    # -- hosts --------------------------------------------------------------------------------

    def ip(self, host: int) -> str:
        """Address of ``host`` on the impaired link."""
        return self.hosts[host].ip

    def popen(self, host: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host``'s namespace; it is killed when the network closes.

        Runs in its own session (Ctrl-C reaches only the test; cleanup kills the whole group).
        ``kwargs`` go to ``subprocess.Popen``.
        """
        if self._closed:
            raise RuntimeError("network is closed")
        kwargs.setdefault("start_new_session", True)
        proc: subprocess.Popen[Any] = subprocess.Popen(
            bound(["ip", "netns", "exec", self.hosts[host].netns, *argv]), **kwargs
        )
        self._procs.append(proc)
        return proc

    def run(
        self, host: int, argv: Sequence[str], *, timeout: float, **kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` in ``host`` to completion (``subprocess.run`` semantics, with timeout)."""
        if kwargs.pop("capture_output", True):
            kwargs.setdefault("stdout", subprocess.PIPE)
            kwargs.setdefault("stderr", subprocess.PIPE)
        input_ = kwargs.pop("input", None)
        if input_ is not None:
            kwargs.setdefault("stdin", subprocess.PIPE)
        check = kwargs.pop("check", False)
        with self.popen(host, argv, **kwargs) as proc:
            try:
                out, err = proc.communicate(input_, timeout=timeout)
            except BaseException:
                _kill_group(proc)
                proc.wait(timeout=5)
                raise
        done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            done.check_returncode()
        return done

    def python(self, host: int, code: str, *args: str, **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``python -c code args...`` (this interpreter) inside ``host``."""
        return self.popen(host, [sys.executable, "-c", code, *args], **kwargs)

    # -- teardown -----------------------------------------------------------------------------

    def close(self) -> None:
        """Kill host processes, then the forwarder, then delete the namespaces. Idempotent."""
        if self._closed:
            return
        self._closed = True
        errors: list[BaseException] = []
        for step in (self._stop_procs, self._stop_forwarder, self._delete_namespaces):
            try:
                step()
            except BaseException as exc:  # keep tearing down; report the first failure
                errors.append(exc)
        if self._fwd_log is not None:
            self._fwd_log.close()
        if errors:
            raise errors[0]

    def _stop_procs(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                _kill_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            # the group may outlive its leader: always finish it off
            _kill_group(proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=2.0)
            for stream in (proc.stdin, proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        for netns in self._created:  # daemons that left their process group
            _kill_netns_pids(netns, self.timeout)

    def _stop_forwarder(self) -> None:
        fwd = self._forwarder
        if fwd is None:
            return
        if fwd.stdin is not None:
            with contextlib.suppress(OSError):
                fwd.stdin.close()  # EOF: the forwarder exits by itself
        try:
            fwd.wait(timeout=2.0)
        except subprocess.TimeoutExpired:
            fwd.kill()
            fwd.wait(timeout=5.0)
        if fwd.stdout is not None:
            fwd.stdout.close()

    def _delete_namespaces(self) -> None:
        for netns in self._created:
            _ip("netns", "del", netns, timeout=self.timeout, check=False)
        left = set(_netns_names(self.timeout)) & set(self._created)
        if left:
            raise RuntimeError(f"namespaces not deleted: {sorted(left)}")


def _kill_group(proc: subprocess.Popen[Any], sig: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


@contextlib.contextmanager
def impaired_network(
    hosts: int = 2,
    delay_ms: float = 0.0,
    jitter_ms: float = 0.0,
    loss: float = 0.0,
    rate_mbit: float | None = None,
    *,
    limit: int = 1000,
    mtu: int = 1500,
    shaping: Shaping = "uplink",
    seed: int | None = None,
    timeout: float = 10.0,
) -> Iterator[Network]:
    """``hosts`` namespaces on one impaired link; everything is torn down on exit.

    ``delay_ms``/``jitter_ms``/``loss``/``rate_mbit`` apply to each direction (RTT = 2 x delay);
    ``rate_mbit=None`` means no cap. ``timeout`` bounds every ``ip`` call and forwarder request.
    """
    impairment = Impairment(delay_ms, jitter_ms, loss, rate_mbit, limit)
    net = Network(hosts, impairment, mtu=mtu, shaping=shaping, seed=seed, timeout=timeout)
    try:
        yield net
    finally:
        net.close()


# -- the forwarder (runs as ``python netimpair.py``; stdlib only) ----------------------------


class _Queue:
    """One netem-like queue: its settings, its clock and its counters."""

    __slots__ = (
        "byte_time",
        "delay",
        "jitter",
        "last",
        "limit",
        "loss",
        "lost",
        "overflow",
        "queued",
        "rx",
        "sent",
    )

    def __init__(self, impairment: dict[str, Any]) -> None:
        self.configure(impairment)
        self.last = 0.0  # departure time of the packet queued last
        self.queued = self.rx = self.sent = self.lost = self.overflow = 0

    def configure(self, impairment: dict[str, Any]) -> None:
        imp = Impairment(**impairment)
        self.delay = imp.delay_ms / 1000.0
        self.jitter = imp.jitter_ms / 1000.0
        self.loss = imp.loss
        self.byte_time = 0.0 if imp.rate_mbit is None else 8.0 / (imp.rate_mbit * 1e6)
        self.limit = imp.limit

    def counters(self) -> dict[str, int]:
        return {
            "rx": self.rx,
            "sent": self.sent,
            "lost": self.lost,
            "overflow": self.overflow,
            "queued": self.queued,
        }


def _forward(config: dict[str, Any], ctrl_in: int, ctrl_out: int) -> None:
    """Move packets between the TUN fds until the control pipe closes.

    One thread, one epoll: reads are batched per wake-up, due packets leave from a heap keyed
    by departure time, and epoll sleeps exactly until the next departure.
    """
    import heapq
    import itertools
    import random

    fds: list[int] = config["fds"]
    n = len(fds)
    rnd = random.Random(config["seed"]).random
    by_ip = {bytes(int(b) for b in ip.split(".")): i for i, ip in enumerate(config["ips"])}
    pair = config["shaping"] == "pair"
    queues: dict[tuple[int, int | None], _Queue] = {}
    for s in range(n):
        for d in range(n) if pair else [None]:
            if s != d:
                queues[(s, d)] = _Queue(config["impairment"])
    host_of_fd = {fd: i for i, fd in enumerate(fds)}
    unroutable = 0
    heap: list[tuple[float, int, _Queue, int, bytes]] = []
    seq = itertools.count()
    push, pop = heapq.heappush, heapq.heappop
    read, write, clock = os.read, os.write, time.monotonic

    def stats() -> dict[str, Any]:
        counts = [q.counters() for q in queues.values()]
        links = [{"src": s, "dst": d, **c} for (s, d), c in zip(queues, counts, strict=True)]
        total = {k: sum(c[k] for c in counts) for k in ("rx", "sent", "lost", "overflow")}
        total["unroutable"] = unroutable
        return {"links": links, "total": total}

    def control(line: bytes) -> dict[str, Any]:
        msg = json.loads(line)
        if msg.get("op") == "stats":
            return {"ok": True, "stats": stats()}
        if msg.get("op") == "set":
            for (s, d), q in queues.items():
                if msg["src"] in (None, s) and msg["dst"] in (None, d):
                    q.configure(msg["impairment"])
            return {"ok": True}
        return {"ok": False, "error": f"unknown op {msg.get('op')!r}"}

    ep = select.epoll()
    for fd in fds:
        ep.register(fd, select.EPOLLIN)
    ep.register(ctrl_in, select.EPOLLIN)
    write(ctrl_out, b'{"ok": true}\n')
    ctrl_buf = b""
    while True:
        timeout = max(0.0, heap[0][0] - clock()) if heap else -1.0
        events = ep.poll(timeout)
        now = clock()
        for fd, _ in events:
            if fd == ctrl_in:
                chunk = read(ctrl_in, 65536)
                if not chunk:
                    return
                ctrl_buf += chunk
                while b"\n" in ctrl_buf:
                    line, ctrl_buf = ctrl_buf.split(b"\n", 1)
                    try:
                        reply = control(line)
                    except Exception as exc:
                        reply = {"ok": False, "error": repr(exc)}
                    write(ctrl_out, json.dumps(reply).encode() + b"\n")
                continue
            src = host_of_fd[fd]
            for _ in range(256):
                try:
                    pkt = read(fd, 65536)
                except BlockingIOError:
                    break
                dst = by_ip.get(pkt[16:20]) if len(pkt) >= 20 and pkt[0] >> 4 == 4 else None
                if dst is None or dst == src:
                    unroutable += 1
                    continue
                q = queues[(src, dst if pair else None)]
                q.rx += 1
                if q.loss and rnd() < q.loss:
                    q.lost += 1
                    continue
                if q.queued >= q.limit:
                    q.overflow += 1
                    continue
                t = now + q.delay
                if q.jitter:
                    t += (2.0 * rnd() - 1.0) * q.jitter
                if t < q.last:
                    t = q.last
                t += len(pkt) * q.byte_time
                q.last = t
                if t <= now:
                    q.sent += 1
                    with contextlib.suppress(OSError):
                        write(fds[dst], pkt)
                    continue
                q.queued += 1
                push(heap, (t, next(seq), q, fds[dst], pkt))
        now = clock()
        while heap and heap[0][0] <= now:
            _, _, q, out, pkt = pop(heap)
            q.queued -= 1
            q.sent += 1
            with contextlib.suppress(OSError):  # e.g. the host's interface went down
                write(out, pkt)


def _forwarder_main() -> None:
    """Entry point of the forwarder process: config is the first line on stdin."""
    import gc

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(OSError):
        os.nice(-10)  # a faithful link needs the forwarder scheduled promptly on a busy machine
    gc.disable()  # no reference cycles here; avoid pauses in the packet path
    line = b""
    while not line.endswith(b"\n"):  # unbuffered: later control lines must stay in the pipe
        byte = os.read(0, 1)
        if not byte:
            return
        line += byte
    _forward(json.loads(line), 0, 1)


if __name__ == "__main__":
    _forwarder_main()
