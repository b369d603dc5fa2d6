"""The frontends, above the runtime: the offline ``LLM`` API (``llm``), the async one
(``async_engine``) and their output processing. Rooms below: ``cli/`` is the ``strata``
command, ``server/`` the OpenAI-compatible HTTP server, ``bench/`` the benchmarks.
"""
