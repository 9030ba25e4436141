"""Benchmarks: behind ``ember bench`` (``throughput``, ``serve``; also ``python -m ember.bench
throughput|serve``) and, for the GPU kernels and engine internals, modules run as
``python -m ember.bench.NAME``:

    ceilings            copy bandwidth and matmul rate, and the limits they put on models
    attention_kernels   decode attention bandwidth over configs (and flashinfer's)
    decode_latency      decode attention per layer at small batch and short context
    small_batch_linear  the small-batch linear kernel against cuBLAS per projection shape
    profile_steps       device time per kernel and host time per engine step
    server_limits       /health latency and memory while hostile clients attack the server
    structured          throughput with a JSON schema on every request against none
    grammar_host        the structured-output manager's host work per step, without a model
    add_requests        adding a request, with a JSON schema and without
    detokenize          the front end's detokenizer, per token

Helpers: ``workloads`` (synthetic prompts), ``roofline`` (limits from ceilings), ``timing``
(graph replay and do_bench timing), ``provenance``, ``hf_weights``.
"""
