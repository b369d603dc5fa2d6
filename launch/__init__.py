"""Frontends and launchers, above the engine's packages.

Here: the ``strata`` CLI (``cli``), the offline ``LLM`` API (``llm``) and the async one
(``async_engine``), with their engine arguments and output processing. Rooms below:
``engine/`` starts the EngineCore process and talks to it, ``executors/`` runs the workers
(in process, as local processes, on Ray), ``server/`` is the OpenAI-compatible HTTP server,
``bench/`` holds the benchmarks.
"""
