"""Pooling models (embeddings, classification, scoring): vLLM's offline pooling API for ember.

`params` (PoolingParams), `outputs` (the request outputs), `poolers` (CLS / mean / last-token,
resolved through ember.registry.PoolerRegistry), `config` (the pooling set-up read from the
checkpoint: sentence-transformers files, architecture defaults), `runner` (batched forward and
pooling), `core` (the engine core that runs pooling requests, in process or in its own process)
and `api` (LLM.embed / classify / score / encode). Nothing here is imported by `import ember`.
"""
