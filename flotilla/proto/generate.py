"""Regenerate the checked-in protobuf modules: ``python -m flotilla.proto.generate``."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent


def generate(out_dir: Path = ROOT) -> list[Path]:
    """Run protoc on flotilla.proto into ``out_dir`` and return the written files."""
    from grpc_tools import protoc

    proto = HERE / "flotilla.proto"
    out_dir = Path(out_dir)
    (out_dir / "flotilla" / "proto").mkdir(parents=True, exist_ok=True)  # protoc will not
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(proto.relative_to(ROOT)),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed")
    written = [
        out_dir / "flotilla/proto" / n
        for n in ("flotilla_pb2.py", "flotilla_pb2.pyi", "flotilla_pb2_grpc.py")
    ]
    return written


if __name__ == "__main__":
    for path in generate():
        sys.stdout.write(f"{path}\n")
