"""Helpers the tests share, in one place (``conftest.py`` keeps only fixtures; test modules
never import each other).

- ``inproc``: the server core and real agents in one process (``in_process_federation``).
- ``processes``: real ``flotilla server`` / ``flotilla client`` processes and the CLI.
- ``databases``: the databases a test runs on (SQLite; PostgreSQL when asked).
- ``live_grpc``: a server in the test's event loop and a raw gRPC client to poke it with.
- ``lifetime``: every process a test starts dies with the test run.
- ``netimpair``: hosts in network namespaces joined through an impaired link.
- ``experiments``: small simulator experiment files and their metrics.
- ``byzantine_task``, ``half_upload_agent``, ``peers/``, ``previous_schema``: a task, an
  agent script, a hivemind peer script and the previous release's schema, for the tests
  that need them.
"""
