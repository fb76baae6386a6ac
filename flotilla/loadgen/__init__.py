"""Load generation: hundreds of protocol-true devices against a real server (docs/load.md).

- :mod:`flotilla.loadgen.device` -- one device's loop (enrol, poll, fetch, signed upload).
- :mod:`flotilla.loadgen.http_transport` -- the agent's requests over the HTTP device protocol.
- :mod:`flotilla.loadgen.worker` -- a process running many devices on one event loop.
- :mod:`flotilla.loadgen.run` -- a whole run: server, workers, sampling, the books checked.
"""
