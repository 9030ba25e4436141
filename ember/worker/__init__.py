"""The worker: `builder` makes a ready model runner once (platform, model, weights, KV cache,
graphs, then `warmup`'s dummy steps at the engine's shapes, each stage timed by
`startup_profile`); `model_runner` runs the engine's steps on it, with `input_stager`,
`graph_runner` and `in_flight` for staging inputs, replaying decode graphs and bringing sampled
tokens home."""
