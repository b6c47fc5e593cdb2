"""Benchmarks: side by side timings (dense baseline and floor in the same run) that print a table and write JSON.

``condcomp bench attention`` (one routed attention layer), ``bench compile`` (torch.compile), ``bench decode``
(a routed causal LM's prefill and decode with a compact KV cache), ``bench scatter`` (native scatter-adds against
torch-scatter), ``bench gpu-check`` (on a CUDA GPU: every gathered strategy checked against the reference, then
dense, the k-head floor, masked and gathered timed within a time budget; also ``python -m condcomp.bench.gpu_check``
on a machine without the command installed).
Committed results: ``results/bench/<benchmark>/<run>/``.

Benchmarks may import the studies' helpers (``condcomp.experiments``); nothing under ``condcomp.experiments``
imports a benchmark.
"""
