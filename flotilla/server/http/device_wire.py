"""Every JSON body of the device protocol, parsed strictly or rendered, in one place.

The server checks incoming JSON by hand, not with a JSON Schema library: the base install
stays small, and each refusal names the field and what it must be. The schemas under
``flotilla/mobile/schema/v1/`` describe the same shapes; a test holds the two together.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Mapping
from typing import Any

from flotilla.core.conditions import DeviceConditions
from flotilla.core.device import MAX_TASK_NAME, DeviceProfile, sample_counts
from flotilla.core.errors import WireError
from flotilla.core.identity import NONCE_BYTES, SIGNATURE_BYTES
from flotilla.core.work import RoundRef, UploadHeader, WorkOrder

#: The protocol version: in every response (header ``Flotilla-Protocol`` and the body's
#: ``protocol``) and in the enrolment request.
PROTOCOL = 1
PROTOCOL_HEADER = "Flotilla-Protocol"
#: Longest string field a device may send (ids, tokens, reasons, codec names).
MAX_TEXT = 256
MAX_TASKS = 64
MAX_METRICS = 64
_SHA_CHARS = frozenset("0123456789abcdef")
#: float64's largest finite value.
F64_MAX = sys.float_info.max


class Fields:
    """A JSON object read field by field; :meth:`done` refuses any field nobody asked for."""

    def __init__(self, data: object, where: str) -> None:
        if not isinstance(data, dict):
            raise WireError(f"{where}: expected a JSON object, got {_kind(data)}")
        self._data: dict[str, Any] = data
        self._where = where
        self._seen: set[str] = set()

    def _get(self, name: str, required: bool) -> Any:
        self._seen.add(name)
        if name not in self._data:
            if required:
                raise WireError(f"{self._where}: missing field '{name}'")
            return None
        return self._data[name]

    def text(self, name: str, required: bool = True, default: str = "") -> str:
        value = self._get(name, required)
        if value is None and not required:
            return default
        if not isinstance(value, str) or len(value) > MAX_TEXT:
            raise WireError(f"{self._where}: '{name}' must be a string of at most {MAX_TEXT}")
        return value

    def integer(self, name: str, required: bool = True, low: int = 0) -> int:
        value = self._get(name, required)
        if value is None and not required:
            return low
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value < 2**63:
            raise WireError(f"{self._where}: '{name}' must be an integer >= {low}")
        return value

    def number(self, name: str, required: bool = True) -> float:
        value = self._get(name, required)
        if value is None and not required:
            return 0.0
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise WireError(f"{self._where}: '{name}' must be a number")
        if not _finite(value) or value < 0:
            raise WireError(f"{self._where}: '{name}' must be finite and >= 0")
        return float(value)

    def sha256(self, name: str) -> str:
        value = self.text(name)
        if len(value) != 64 or not set(value) <= _SHA_CHARS:
            raise WireError(f"{self._where}: '{name}' must be 64 lowercase hex digits")
        return value

    def hex_bytes(self, name: str, size: int) -> bytes:
        """An optional field of ``size`` bytes as ``2 * size`` lowercase hex digits (b"" if
        absent): the core says what it means for an update to lack it."""
        value = self.text(name, required=False)
        if not value:
            return b""
        if len(value) != 2 * size or not set(value) <= _SHA_CHARS:
            raise WireError(f"{self._where}: '{name}' must be {2 * size} lowercase hex digits")
        return bytes.fromhex(value)

    def obj(self, name: str, required: bool = False) -> Any:
        """A nested value, parsed by the caller; None when absent (or null)."""
        return self._get(name, required)

    def done(self) -> None:
        unknown = sorted(set(self._data) - self._seen)
        if unknown:
            raise WireError(f"{self._where}: unknown field(s) {', '.join(unknown)}")


def _finite(value: float) -> bool:
    """Finite as a float: JSON ints past float's range (10**400) are not (math.isfinite and
    float() raise OverflowError on them)."""
    if isinstance(value, int):
        return abs(value) <= F64_MAX
    return math.isfinite(value)


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def loads(raw: bytes, where: str) -> object:
    """A request body as JSON; an empty body reads as ``{}``."""
    if not raw.strip():
        return {}
    try:
        return json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8/JSON, huge ints, deep nesting
        raise WireError(f"{where}: not valid UTF-8 JSON ({exc})") from None


# --- requests ------------------------------------------------------------------------------


def profile(data: object, where: str) -> DeviceProfile:
    f = Fields(data, where)
    tasks = f.obj("tasks")
    if not (
        isinstance(tasks, list)
        and 0 < len(tasks) <= MAX_TASKS
        and all(isinstance(t, str) and 0 < len(t) <= MAX_TASK_NAME for t in tasks)
    ):
        raise WireError(f"{where}: 'tasks' must be 1 to {MAX_TASKS} task entry-point names")
    made = DeviceProfile(
        device_id="",
        tasks=tuple(tasks),
        gflops=f.number("gflops", required=False),
        memory_bytes=f.integer("memory_bytes", required=False),
        upload_bytes_per_s=f.number("upload_bytes_per_s", required=False),
        device_class=f.text("device_class", required=False),
        samples=_samples(f.obj("samples"), where),
    )
    f.done()
    return made


def _samples(value: object, where: str) -> dict[str, int]:
    """``samples``: task -> training samples held; absent or null: none counted."""
    return {} if value is None else sample_counts(value, where)


def enrol_request(data: object) -> tuple[str, DeviceProfile, str]:
    """``(enrolment token, profile, public key)``; a protocol this server does not speak is
    refused. The key (hex Ed25519, ``""`` if absent) is checked where it is registered."""
    f = Fields(data, "enrol request")
    version = f.integer("protocol")
    if version != PROTOCOL:
        raise WireError(f"protocol version {version} not supported; this server speaks {PROTOCOL}")
    token = f.text("token")
    made = profile(f.obj("profile", required=True), "enrol request: profile")
    public_key = f.text("public_key", required=False)
    f.done()
    return token, made, public_key


def conditions(value: object, where: str) -> DeviceConditions | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise WireError(f"{where}: expected a JSON object, got {_kind(value)}")
    return DeviceConditions.from_dict(value, where)


def poll_request(data: object) -> tuple[DeviceProfile | None, DeviceConditions | None]:
    f = Fields(data, "poll request")
    raw_profile = f.obj("profile")
    made = None if raw_profile is None else profile(raw_profile, "poll request: profile")
    conds = conditions(f.obj("conditions"), "poll request: conditions")
    f.done()
    return made, conds


def heartbeat_request(data: object) -> tuple[str, DeviceConditions | None]:
    f = Fields(data, "heartbeat request")
    token = f.text("round_token")
    conds = conditions(f.obj("conditions"), "heartbeat request: conditions")
    f.done()
    return token, conds


def _ref(f: Fields) -> RoundRef:
    return RoundRef(f.text("job_id"), f.integer("round", low=1), f.text("round_token"))


def upload_request(data: object) -> UploadHeader:
    """What a device declares before its first byte: round, size, checksum, codec."""
    f = Fields(data, "upload request")
    ref = _ref(f)
    header = UploadHeader(
        ref=ref,
        num_samples=f.integer("num_samples", low=1),
        payload_size=f.integer("size", low=1),
        payload_sha256=f.sha256("sha256"),
        codec=f.text("codec", required=False),
        metrics=metrics(f.obj("metrics"), "upload request: metrics"),
        nonce=f.hex_bytes("nonce", NONCE_BYTES),
        signature=f.hex_bytes("signature", SIGNATURE_BYTES),
    )
    f.done()
    return header


def metrics(value: object, where: str) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > MAX_METRICS:
        raise WireError(f"{where}: expected an object of at most {MAX_METRICS} numbers")
    out = {}
    for key, number in value.items():
        if len(key) > 64 or isinstance(number, bool) or not isinstance(number, (int, float)):
            raise WireError(f"{where}: '{key[:64]}' must be a number (names up to 64 chars)")
        if not _finite(number):
            raise WireError(f"{where}: '{key[:64]}' must be finite")
        out[key] = float(number)
    return out


def failure_request(data: object) -> tuple[RoundRef, str]:
    f = Fields(data, "failure report")
    ref = _ref(f)
    reason = f.text("reason")
    f.done()
    return ref, reason


def leave_request(data: object) -> str:
    f = Fields(data, "leave request")
    reason = f.text("reason", required=False)
    f.done()
    return reason


#: Headers of a secure-round message (``POST /device/v1/secagg/{job_id}/{round}/{stage}``).
ROUND_TOKEN_HEADER = "Flotilla-Round-Token"


def secagg_path(path: Mapping[str, str], headers: Mapping[str, str]) -> tuple[RoundRef, int]:
    """The round and stage a secure-round message is for: job, round and stage in the
    path, the round token in its header. WireError naming what is wrong."""
    job_id = path.get("job_id", "")
    token = headers.get(ROUND_TOKEN_HEADER, "")
    if not 0 < len(job_id) <= MAX_TEXT or not 0 < len(token) <= MAX_TEXT:
        raise WireError(
            f"a secure-round message names its job in the path and its round in a "
            f"{ROUND_TOKEN_HEADER} header (1 to {MAX_TEXT} characters each)"
        )
    numbers = []
    for name in ("round", "stage"):
        text = path.get(name, "")
        if not (text.isdigit() and len(text) <= 9):
            raise WireError(f"secure-round message: {name} in the path must be a whole number")
        numbers.append(int(text))
    return RoundRef(job_id, numbers[0], token), numbers[1]


# --- responses -----------------------------------------------------------------------------


def task_json(order: WorkOrder, codec: str, transport: str, max_upload: int) -> dict[str, Any]:
    """A work order as a device reads it; ``codec`` is the uplink codec it must use."""
    return {
        "job_id": order.job_id,
        "round": order.round,
        "round_token": order.round_token,
        "task": order.task,
        "config": json.loads(order.config_json or "{}"),
        "model_sha256": order.model_sha256,
        "model_size": order.model_size,
        "model_url": f"/device/v1/models/{order.model_sha256}",
        "deadline": order.deadline,
        "seed": order.seed,
        "delta_base_sha256": order.delta_base_sha256,
        "delta_sha256": order.delta_sha256,
        "delta_size": order.delta_size,
        "uplink_codec": codec,
        "transport": transport,
        "max_upload_bytes": max_upload,
    }
