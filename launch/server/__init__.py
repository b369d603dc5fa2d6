"""The OpenAI-compatible HTTP server: ``serve`` runs it (``strata serve``), ``app`` holds the
routes, ``completions`` turns requests into engine calls and responses, ``protocol`` validates
the request bodies, ``metrics`` is ``/metrics``."""
