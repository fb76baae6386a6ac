"""What devices download for each committed model.

Three ways, from the job's ``[compression]`` section:

- ``downlink = "none"``: the exact checkpoint.
- a lossy ``downlink`` codec: the checkpoint encoded with it (devices decode, train, and
  send their delta from what they received; the server adds it to the exact model).
- ``downlink_delta = true``: devices that hold the previous broadcast fetch only the
  codec-compressed change since it. The server keeps the model those devices rebuild
  (the *reference*) and encodes each new checkpoint's difference from it, so what a
  codec drops one round is sent the next: error feedback for the downlink. The rebuilt
  model is stored whole as well, for devices that missed a round, and every device
  checks its rebuild against that blob's SHA-256.
"""

from __future__ import annotations

from dataclasses import dataclass

from flotilla.compression import Codec, apply_delta, decode_state_with, encode_state_with
from flotilla.core.tensors import ModelState, decode_state, encode_state, state_spec
from flotilla.engine.ports import Blobs


@dataclass(frozen=True, slots=True)
class Broadcast:
    sha256: str
    size: int
    #: For downlink deltas: the model a device must hold to use the delta blob instead.
    delta_base_sha256: str = ""
    delta_sha256: str = ""
    delta_size: int = 0


class Broadcaster:
    """Encodes each checkpoint for download once; called from a worker thread."""

    def __init__(self, blobs: Blobs, codec: Codec | None, delta: bool) -> None:
        self._blobs = blobs
        self._codec = codec
        self._delta = delta and codec is not None
        #: The model devices rebuild from deltas, and the SHA-256 of its safetensors.
        self._reference: tuple[ModelState, str] | None = None

    def prepare(self, checkpoint_sha256: str) -> Broadcast:
        blobs, codec = self._blobs, self._codec
        if codec is None:
            return Broadcast(checkpoint_sha256, blobs.path(checkpoint_sha256).stat().st_size)
        model = decode_state(blobs.get_mapped(checkpoint_sha256))
        if not self._delta:
            payload = encode_state_with(codec, model)
            return Broadcast(blobs.put(payload), len(payload))
        if self._reference is None:
            # First broadcast of this process: the exact model, which every device can use.
            self._reference = ({k: v.copy() for k, v in model.items()}, checkpoint_sha256)
            return Broadcast(checkpoint_sha256, blobs.path(checkpoint_sha256).stat().st_size)
        base, base_sha = self._reference
        change = {name: model[name].astype("float32") - base[name] for name in base}
        payload = encode_state_with(codec, change)
        received = decode_state_with(payload, state_spec(base), len(payload), codec=codec)
        rebuilt = apply_delta(base, received)
        whole = encode_state(rebuilt)
        self._reference = (rebuilt, blobs.put(whole))
        return Broadcast(self._reference[1], len(whole), base_sha, blobs.put(payload), len(payload))
