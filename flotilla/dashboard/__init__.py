"""What an operator or researcher looks at: the read model behind the dashboard and the
``/api/v1`` read routes, served over a live federation or a simulation's output directory."""
