"""The runtime a frontend starts: the EngineCore process and its clients, the executors that
run the workers, and data-parallel replicas behind one client.

``engine_args`` declares every engine flag and resolves it into the scheduler's and the workers'
configs; ``core_process`` is the EngineCore process's entry point and ``core_client`` talks to
it over ZeroMQ; ``inproc_client`` runs the EngineCore in the caller's process instead. Rooms
below: ``executors/`` (in process, local processes, Ray) and ``data_parallel/`` (replicas and
their router). Imports run ``launch -> runtime -> worker -> connector -> engine_core``.
"""
