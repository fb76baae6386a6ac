"""Edge and mobile devices: what a phone or a single-board computer needs to join a job.

Module map:

- :mod:`flotilla.mobile.manifest` -- :class:`ExportManifest`, the versioned JSON beside an
  exported training program (parameter names, shapes and SHA-256s, inputs, the job's
  optimiser settings); torch-free.
- :mod:`flotilla.mobile.export` -- ``flotilla job export --format executorch``: a job's
  model and loss as an ExecuTorch training program (``.pte``; the ``mobile-export`` extra).
- ``schema/v1/`` -- JSON Schemas of every message of the HTTP device protocol
  (docs/protocol.md).
- :mod:`flotilla.mobile.runtime` -- ExecuTorch imported only where used: the pinned
  version, the install hint, loading a training program (torch-free at import).
- :mod:`flotilla.mobile.lite` -- the torch-free reference client (``lite.http``: the
  protocol's standard-library client; ``lite.program``: ``--program``, training through
  an export, the lite client's one path to ExecuTorch).

Importing this package imports nothing: each module is imported by whoever needs it, so a
torch-free device never loads the exporter.
"""

from __future__ import annotations

__all__: list[str] = []
