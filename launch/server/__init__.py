"""The OpenAI-compatible HTTP server: ``serve`` runs it (``strata serve``), ``app`` holds the
routes, ``completions`` turns requests into engine calls and responses, ``streams`` merges a
request's engine streams into its choices and sends them as server-sent events, ``protocol``
validates the request bodies, ``metrics`` is ``/metrics``."""
