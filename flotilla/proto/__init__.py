"""Wire protocol: ``flotilla.proto`` and the code protoc generates from it (checked in).

Regenerate with ``python -m flotilla.proto.generate``; a test checks the files are current.
"""

#: Sent in the first message an agent sends; bumped on incompatible wire changes.
PROTOCOL_VERSION = 1

__all__ = ["PROTOCOL_VERSION"]
