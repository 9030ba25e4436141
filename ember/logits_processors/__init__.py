"""Logits processors: the contract (interface), the built-ins (builtin), the per-runner set and its
per-step selection (pipeline), and the front end's checks of a request (validation).

Write one by subclassing `LogitsProcessor` and register it with
``ember.registry.LogitsProcessorRegistry.register_logits_processor(name, "mod:Cls")`` (or the
``ember_register_logits_processors`` plugin hook); a request selects it with
``SamplingParams(extra_args={name: args})``. docs/plugins.md has an example.
"""

from ember.logits_processors.interface import LogitsProcessor, ProcessorContext, RowState

__all__ = ["LogitsProcessor", "ProcessorContext", "RowState"]
