"""Benchmarks behind ``strata bench``: offline ``throughput``, HTTP ``serve`` load, KV
``offload``, and the model-free ``scheduler`` micro-benchmark."""
