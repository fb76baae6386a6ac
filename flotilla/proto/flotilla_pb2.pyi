from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DeviceProfile(_message.Message):
    __slots__ = ("tasks", "gflops", "memory_bytes", "upload_bytes_per_s", "device_class", "samples")
    class SamplesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    TASKS_FIELD_NUMBER: _ClassVar[int]
    GFLOPS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    tasks: _containers.RepeatedScalarFieldContainer[str]
    gflops: float
    memory_bytes: int
    upload_bytes_per_s: float
    device_class: str
    samples: _containers.ScalarMap[str, int]
    def __init__(self, tasks: _Optional[_Iterable[str]] = ..., gflops: _Optional[float] = ..., memory_bytes: _Optional[int] = ..., upload_bytes_per_s: _Optional[float] = ..., device_class: _Optional[str] = ..., samples: _Optional[_Mapping[str, int]] = ...) -> None: ...

class DeviceConditions(_message.Message):
    __slots__ = ("charging", "battery", "network", "idle", "thermal")
    CHARGING_FIELD_NUMBER: _ClassVar[int]
    BATTERY_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    IDLE_FIELD_NUMBER: _ClassVar[int]
    THERMAL_FIELD_NUMBER: _ClassVar[int]
    charging: bool
    battery: float
    network: str
    idle: bool
    thermal: str
    def __init__(self, charging: _Optional[bool] = ..., battery: _Optional[float] = ..., network: _Optional[str] = ..., idle: _Optional[bool] = ..., thermal: _Optional[str] = ...) -> None: ...

class EnrolRequest(_message.Message):
    __slots__ = ("protocol_version", "token", "profile", "public_key")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    token: str
    profile: DeviceProfile
    public_key: str
    def __init__(self, protocol_version: _Optional[int] = ..., token: _Optional[str] = ..., profile: _Optional[_Union[DeviceProfile, _Mapping]] = ..., public_key: _Optional[str] = ...) -> None: ...

class EnrolReply(_message.Message):
    __slots__ = ("device_id", "credential", "protocol_version")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    credential: str
    protocol_version: int
    def __init__(self, device_id: _Optional[str] = ..., credential: _Optional[str] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class SpeedChunk(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class SpeedReply(_message.Message):
    __slots__ = ("bytes", "seconds")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    seconds: float
    def __init__(self, bytes: _Optional[int] = ..., seconds: _Optional[float] = ...) -> None: ...

class PollRequest(_message.Message):
    __slots__ = ("profile", "p2p_peer_id", "conditions")
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    P2P_PEER_ID_FIELD_NUMBER: _ClassVar[int]
    CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    profile: DeviceProfile
    p2p_peer_id: str
    conditions: DeviceConditions
    def __init__(self, profile: _Optional[_Union[DeviceProfile, _Mapping]] = ..., p2p_peer_id: _Optional[str] = ..., conditions: _Optional[_Union[DeviceConditions, _Mapping]] = ...) -> None: ...

class TrainTask(_message.Message):
    __slots__ = ("job_id", "round", "round_token", "task", "config_json", "model_sha256", "model_size", "deadline_unix", "seed", "delta_base_sha256", "delta_sha256", "delta_size", "uplink_codec")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    MODEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_UNIX_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    DELTA_BASE_SHA256_FIELD_NUMBER: _ClassVar[int]
    DELTA_SHA256_FIELD_NUMBER: _ClassVar[int]
    DELTA_SIZE_FIELD_NUMBER: _ClassVar[int]
    UPLINK_CODEC_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    round_token: str
    task: str
    config_json: str
    model_sha256: str
    model_size: int
    deadline_unix: float
    seed: int
    delta_base_sha256: str
    delta_sha256: str
    delta_size: int
    uplink_codec: str
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., round_token: _Optional[str] = ..., task: _Optional[str] = ..., config_json: _Optional[str] = ..., model_sha256: _Optional[str] = ..., model_size: _Optional[int] = ..., deadline_unix: _Optional[float] = ..., seed: _Optional[int] = ..., delta_base_sha256: _Optional[str] = ..., delta_sha256: _Optional[str] = ..., delta_size: _Optional[int] = ..., uplink_codec: _Optional[str] = ...) -> None: ...

class PollReply(_message.Message):
    __slots__ = ("task",)
    TASK_FIELD_NUMBER: _ClassVar[int]
    task: TrainTask
    def __init__(self, task: _Optional[_Union[TrainTask, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("round_token", "conditions")
    ROUND_TOKEN_FIELD_NUMBER: _ClassVar[int]
    CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    round_token: str
    conditions: DeviceConditions
    def __init__(self, round_token: _Optional[str] = ..., conditions: _Optional[_Union[DeviceConditions, _Mapping]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("round_open",)
    ROUND_OPEN_FIELD_NUMBER: _ClassVar[int]
    round_open: bool
    def __init__(self, round_open: _Optional[bool] = ...) -> None: ...

class FetchModelRequest(_message.Message):
    __slots__ = ("job_id", "sha256")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    sha256: str
    def __init__(self, job_id: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class BlobChunk(_message.Message):
    __slots__ = ("data", "offset", "total_size", "sha256")
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    offset: int
    total_size: int
    sha256: str
    def __init__(self, data: _Optional[bytes] = ..., offset: _Optional[int] = ..., total_size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("job_id", "round", "round_token", "num_samples", "metrics", "payload_size", "payload_sha256", "codec", "reservation", "nonce", "signature")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_TOKEN_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SHA256_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    round_token: str
    num_samples: int
    metrics: _containers.ScalarMap[str, float]
    payload_size: int
    payload_sha256: str
    codec: str
    reservation: str
    nonce: bytes
    signature: bytes
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., round_token: _Optional[str] = ..., num_samples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., payload_size: _Optional[int] = ..., payload_sha256: _Optional[str] = ..., codec: _Optional[str] = ..., reservation: _Optional[str] = ..., nonce: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ReserveUploadRequest(_message.Message):
    __slots__ = ("job_id", "round", "round_token", "payload_size")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    round_token: str
    payload_size: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., round_token: _Optional[str] = ..., payload_size: _Optional[int] = ...) -> None: ...

class ReserveUploadReply(_message.Message):
    __slots__ = ("reservation", "expires_in_s")
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    reservation: str
    expires_in_s: float
    def __init__(self, reservation: _Optional[str] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class UpdateChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("accepted", "detail")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    detail: str
    def __init__(self, accepted: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class GiveUpRequest(_message.Message):
    __slots__ = ("job_id", "round", "round_token", "reason")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    round_token: str
    reason: str
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., round_token: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class GiveUpReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SecAggRequest(_message.Message):
    __slots__ = ("job_id", "round", "round_token", "stage", "body")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_TOKEN_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    BODY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    round_token: str
    stage: int
    body: bytes
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., round_token: _Optional[str] = ..., stage: _Optional[int] = ..., body: _Optional[bytes] = ...) -> None: ...

class SecAggReply(_message.Message):
    __slots__ = ("body",)
    BODY_FIELD_NUMBER: _ClassVar[int]
    body: bytes
    def __init__(self, body: _Optional[bytes] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubmitJobRequest(_message.Message):
    __slots__ = ("spec_json",)
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    spec_json: str
    def __init__(self, spec_json: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id", "with_rounds")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    WITH_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    with_rounds: bool
    def __init__(self, job_id: _Optional[str] = ..., with_rounds: _Optional[bool] = ...) -> None: ...

class RoundInfo(_message.Message):
    __slots__ = ("round", "metrics", "participants", "started_at", "committed_at", "devices", "checkpoint_sha256", "selected", "failures", "stale", "bytes_up", "bytes_down", "decisions")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ROUND_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    PARTICIPANTS_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_SHA256_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    BYTES_UP_FIELD_NUMBER: _ClassVar[int]
    BYTES_DOWN_FIELD_NUMBER: _ClassVar[int]
    DECISIONS_FIELD_NUMBER: _ClassVar[int]
    round: int
    metrics: _containers.ScalarMap[str, float]
    participants: _containers.RepeatedScalarFieldContainer[str]
    started_at: float
    committed_at: float
    devices: _containers.RepeatedCompositeFieldContainer[Participation]
    checkpoint_sha256: str
    selected: _containers.RepeatedScalarFieldContainer[str]
    failures: _containers.RepeatedCompositeFieldContainer[RoundFailure]
    stale: _containers.RepeatedScalarFieldContainer[str]
    bytes_up: int
    bytes_down: int
    decisions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, round: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., participants: _Optional[_Iterable[str]] = ..., started_at: _Optional[float] = ..., committed_at: _Optional[float] = ..., devices: _Optional[_Iterable[_Union[Participation, _Mapping]]] = ..., checkpoint_sha256: _Optional[str] = ..., selected: _Optional[_Iterable[str]] = ..., failures: _Optional[_Iterable[_Union[RoundFailure, _Mapping]]] = ..., stale: _Optional[_Iterable[str]] = ..., bytes_up: _Optional[int] = ..., bytes_down: _Optional[int] = ..., decisions: _Optional[_Iterable[str]] = ...) -> None: ...

class RoundFailure(_message.Message):
    __slots__ = ("device_id", "reason")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    reason: str
    def __init__(self, device_id: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class AverageReport(_message.Message):
    __slots__ = ("job_id", "round", "round_token", "model_sha256", "group_id", "contributors", "allreduce_seconds", "reverted")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROUND_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MODEL_SHA256_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTORS_FIELD_NUMBER: _ClassVar[int]
    ALLREDUCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REVERTED_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    round: int
    round_token: str
    model_sha256: str
    group_id: str
    contributors: _containers.RepeatedCompositeFieldContainer[Participation]
    allreduce_seconds: float
    reverted: int
    def __init__(self, job_id: _Optional[str] = ..., round: _Optional[int] = ..., round_token: _Optional[str] = ..., model_sha256: _Optional[str] = ..., group_id: _Optional[str] = ..., contributors: _Optional[_Iterable[_Union[Participation, _Mapping]]] = ..., allreduce_seconds: _Optional[float] = ..., reverted: _Optional[int] = ...) -> None: ...

class AverageReportReply(_message.Message):
    __slots__ = ("upload", "round_open")
    UPLOAD_FIELD_NUMBER: _ClassVar[int]
    ROUND_OPEN_FIELD_NUMBER: _ClassVar[int]
    upload: bool
    round_open: bool
    def __init__(self, upload: _Optional[bool] = ..., round_open: _Optional[bool] = ...) -> None: ...

class Participation(_message.Message):
    __slots__ = ("device_id", "num_samples", "metrics")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    num_samples: int
    metrics: _containers.ScalarMap[str, float]
    def __init__(self, device_id: _Optional[str] = ..., num_samples: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ...) -> None: ...

class JobInfo(_message.Message):
    __slots__ = ("id", "name", "state", "rounds_committed", "rounds_total", "metrics", "rounds", "task", "created_at", "spec_json", "updated_at")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_COMMITTED_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    UPDATED_AT_FIELD_NUMBER: _ClassVar[int]
    id: str
    name: str
    state: str
    rounds_committed: int
    rounds_total: int
    metrics: _containers.ScalarMap[str, float]
    rounds: _containers.RepeatedCompositeFieldContainer[RoundInfo]
    task: str
    created_at: float
    spec_json: str
    updated_at: float
    def __init__(self, id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[str] = ..., rounds_committed: _Optional[int] = ..., rounds_total: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., rounds: _Optional[_Iterable[_Union[RoundInfo, _Mapping]]] = ..., task: _Optional[str] = ..., created_at: _Optional[float] = ..., spec_json: _Optional[str] = ..., updated_at: _Optional[float] = ...) -> None: ...

class ListJobsReply(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[JobInfo]
    def __init__(self, jobs: _Optional[_Iterable[_Union[JobInfo, _Mapping]]] = ...) -> None: ...

class ListDevicesRequest(_message.Message):
    __slots__ = ("task", "job_id")
    TASK_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    task: str
    job_id: str
    def __init__(self, task: _Optional[str] = ..., job_id: _Optional[str] = ...) -> None: ...

class DeviceInfo(_message.Message):
    __slots__ = ("id", "state", "job_id", "reason", "tasks", "gflops", "upload_bytes_per_s", "last_seen", "selected", "device_class", "conditions", "ineligible", "samples")
    class SelectedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class IneligibleEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    class SamplesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    GFLOPS_FIELD_NUMBER: _ClassVar[int]
    UPLOAD_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    LAST_SEEN_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    DEVICE_CLASS_FIELD_NUMBER: _ClassVar[int]
    CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    INELIGIBLE_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    id: str
    state: str
    job_id: str
    reason: str
    tasks: _containers.RepeatedScalarFieldContainer[str]
    gflops: float
    upload_bytes_per_s: float
    last_seen: float
    selected: _containers.ScalarMap[str, int]
    device_class: str
    conditions: DeviceConditions
    ineligible: _containers.ScalarMap[str, str]
    samples: _containers.ScalarMap[str, int]
    def __init__(self, id: _Optional[str] = ..., state: _Optional[str] = ..., job_id: _Optional[str] = ..., reason: _Optional[str] = ..., tasks: _Optional[_Iterable[str]] = ..., gflops: _Optional[float] = ..., upload_bytes_per_s: _Optional[float] = ..., last_seen: _Optional[float] = ..., selected: _Optional[_Mapping[str, int]] = ..., device_class: _Optional[str] = ..., conditions: _Optional[_Union[DeviceConditions, _Mapping]] = ..., ineligible: _Optional[_Mapping[str, str]] = ..., samples: _Optional[_Mapping[str, int]] = ...) -> None: ...

class ListDevicesReply(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceInfo]
    def __init__(self, devices: _Optional[_Iterable[_Union[DeviceInfo, _Mapping]]] = ...) -> None: ...

class RevokeDeviceRequest(_message.Message):
    __slots__ = ("device_id",)
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    def __init__(self, device_id: _Optional[str] = ...) -> None: ...

class RevokeDeviceReply(_message.Message):
    __slots__ = ("device_id", "revoked_at")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    REVOKED_AT_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    revoked_at: float
    def __init__(self, device_id: _Optional[str] = ..., revoked_at: _Optional[float] = ...) -> None: ...

class ListRefusalsRequest(_message.Message):
    __slots__ = ("device_id", "job_id", "limit")
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    device_id: str
    job_id: str
    limit: int
    def __init__(self, device_id: _Optional[str] = ..., job_id: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class RefusalInfo(_message.Message):
    __slots__ = ("at", "device_id", "job_id", "round", "reason", "detail")
    AT_FIELD_NUMBER: _ClassVar[int]
    DEVICE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    at: float
    device_id: str
    job_id: str
    round: int
    reason: str
    detail: str
    def __init__(self, at: _Optional[float] = ..., device_id: _Optional[str] = ..., job_id: _Optional[str] = ..., round: _Optional[int] = ..., reason: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...

class ListRefusalsReply(_message.Message):
    __slots__ = ("refusals",)
    REFUSALS_FIELD_NUMBER: _ClassVar[int]
    refusals: _containers.RepeatedCompositeFieldContainer[RefusalInfo]
    def __init__(self, refusals: _Optional[_Iterable[_Union[RefusalInfo, _Mapping]]] = ...) -> None: ...

class ListVolunteerRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VolunteerRunInfo(_message.Message):
    __slots__ = ("run", "task", "maddrs", "coordinator_key", "status_json")
    RUN_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    MADDRS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_KEY_FIELD_NUMBER: _ClassVar[int]
    STATUS_JSON_FIELD_NUMBER: _ClassVar[int]
    run: str
    task: str
    maddrs: _containers.RepeatedScalarFieldContainer[str]
    coordinator_key: str
    status_json: str
    def __init__(self, run: _Optional[str] = ..., task: _Optional[str] = ..., maddrs: _Optional[_Iterable[str]] = ..., coordinator_key: _Optional[str] = ..., status_json: _Optional[str] = ...) -> None: ...

class ListVolunteerRunsReply(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[VolunteerRunInfo]
    def __init__(self, runs: _Optional[_Iterable[_Union[VolunteerRunInfo, _Mapping]]] = ...) -> None: ...
