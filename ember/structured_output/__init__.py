"""Structured outputs: generation constrained by a JSON schema, regex, choice or grammar.

- `config`: `StructuredOutputsConfig` (EngineArgs.structured_outputs_config: the backend).
- `interface`: the grammar-backend contract (`StructuredOutputBackend`, `Grammar`, `GrammarSpec`);
  backends are found by name in ember.registry.GrammarBackendRegistry (built in: `xgrammar`, the
  default, and `guidance`, llguidance; plugins add others).
- `validation`: the front end's check of a request (the backend chosen, a ValueError naming what
  the backend cannot compile), before the request reaches the engine core.
- `manager`: the engine core's side: grammars compiled on a thread pool with a cache keyed by
  the spec, each request's grammar state advanced with its sampled tokens, and the step's token
  bitmask filled for the rows that sample under a grammar.
- `bitmask`: the bitmask applied to the logits on the device (the sampler calls it).

Importing this package imports neither torch nor a grammar library.
"""

from ember.structured_output.config import StructuredOutputsConfig

__all__ = ["StructuredOutputsConfig"]
