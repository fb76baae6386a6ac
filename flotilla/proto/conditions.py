"""Device conditions on the wire, both ways: agents send them, operators read them back.

One module for the client, the server and the CLI, so a field can never be read one way
and written another. Unset optional fields are "cannot tell" (``None``); an empty network
or thermal string reads as ``unknown``. Values out of range are a :class:`WireError`.
"""

from __future__ import annotations

from flotilla.core.conditions import DeviceConditions
from flotilla.proto import flotilla_pb2 as pb


def conditions_to_pb(conditions: DeviceConditions) -> pb.DeviceConditions:
    msg = pb.DeviceConditions(network=conditions.network, thermal=conditions.thermal)
    if conditions.charging is not None:
        msg.charging = conditions.charging
    if conditions.battery is not None:
        msg.battery = conditions.battery
    if conditions.idle is not None:
        msg.idle = conditions.idle
    return msg


def conditions_from_pb(msg: pb.DeviceConditions) -> DeviceConditions:
    """The core value (WireError, naming the field, for a bad battery level or name)."""
    return DeviceConditions(
        charging=msg.charging if msg.HasField("charging") else None,
        battery=msg.battery if msg.HasField("battery") else None,
        network=msg.network or "unknown",
        idle=msg.idle if msg.HasField("idle") else None,
        thermal=msg.thermal or "unknown",
    )


__all__ = ["conditions_from_pb", "conditions_to_pb"]
