"""Executors run the tensor-parallel workers for the EngineCore: in its process (``uni``), as
local processes (``mp``), or as Ray actors (``ray``); ``zmq_executor`` is the per-step ZeroMQ
path the last two share, ``ray_launcher`` starts Ray nodes (``strata launch ray``)."""
