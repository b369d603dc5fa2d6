"""The EngineCore as a frontend sees it: its process entry point (``engine_process``), the
clients that talk to it over ZeroMQ (``core_client``), and how a frontend starts one in its own
process or beside it (``engine_client``)."""
