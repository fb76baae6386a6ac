"""What an operator or researcher looks at: the read model behind the dashboard and the
``/api/v1`` read routes, served over a live federation or a simulation's output directory.

- ``model``: the :class:`ReadModel` values and the protocols a source implements.
- ``render``: the JSON of every value, in one place.
- ``app``: :func:`build_read_app`, the read routes and the static page over a model.
- ``guard``: bearer tokens (:class:`Authorizer`) and the one error -> status table.
- ``events``: the server-sent events of ``/api/v1/events``.
- ``cache``: rendered answers, kept until the model says they changed.
- ``history``: device counts over time (a ring buffer).
- ``simulation``: :class:`SimulationSource`, the model over a simulation's output
  directory, followed while ``flotilla simulate`` writes it (``tail`` reads the files).
- ``static/``: the page, shipped in the package.
"""
