"""Benchmarks: side by side timings (dense baseline and floor in the same run) that print a table and write JSON.

``condcomp bench attention`` (one routed attention layer), ``bench compile`` (torch.compile), ``bench decode``
(a routed causal LM's prefill and decode with a compact KV cache).
"""
