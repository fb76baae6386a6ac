"""The hivemind peers a federation server hosts, each a child process.

- ``children``: start a child that writes a JSON file when it is up; stop its session.
- ``rendezvous``: :class:`HostedRendezvous`, the DHT node devices of server-less rounds meet at.
- ``volunteers``: :class:`VolunteerHost`, the coordinators of hosted volunteer runs.

hivemind forks its own workers and wants the main thread for signals, which a server
process cannot offer safely, so nothing here imports hivemind or ``flotilla.p2p``: the
children do. The core sees these through ``flotilla.server.federation.ports``.
"""
