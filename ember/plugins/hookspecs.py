"""The versioned plugin contract: pluggy hook specifications a plugin may implement.

Versioning rule (PLUGIN_API_VERSION counts breaking changes only):
- A hook may gain new arguments; it never loses or renames one. pluggy passes a hookimpl only the
  arguments it names, so a plugin written against an older ember keeps working unchanged.
- A hook whose meaning changes gets a new name (``..._v2``); the old one stays for a deprecation
  period of at least one minor release, and PLUGIN_API_VERSION goes up.
- Every hook receives ``api_version`` (an int): a plugin that needs a newer contract can check it
  and raise, which ember records as a clear load failure.

A plugin implements any subset of these hooks, each with any subset of their arguments::

    from ember.plugins import hookimpl

    @hookimpl
    def ember_register_models(registry):
        registry.register_model("MyForCausalLM", "my_pkg.model:MyForCausalLM")

Registrations should be "module:attr" strings: listing what is installed then imports nothing of
the plugin beyond its registration module, and resolution imports only what is chosen.
"""

from __future__ import annotations

import pluggy

PROJECT = "ember"
PLUGIN_API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def ember_register_platforms(registry, api_version):  # type: ignore[no-untyped-def]
    """Register platforms: ``registry.register_platform(name, "mod:Cls", probe="mod:fn")``.

    `registry` is ember.registry.PlatformRegistry. Give a cheap probe: it runs during platform
    selection in every process that selects a platform.
    """


@hookspec
def ember_register_attention_backends(registry, api_version):  # type: ignore[no-untyped-def]
    """Register attention backends with their static capabilities:
    ``registry.register_backend(name, "mod:Cls", devices=[...], dtypes=[...], ...)``.

    `registry` is ember.registry.AttentionBackendRegistry.
    """


@hookspec
def ember_register_quantization_methods(registry, api_version):  # type: ignore[no-untyped-def]
    """Register quantization methods: ``registry.register_quantization_method(name, "mod:Cls")``.

    `registry` is ember.registry.QuantizationRegistry.
    """


@hookspec
def ember_register_models(registry, api_version):  # type: ignore[no-untyped-def]
    """Register model architectures: ``registry.register_model("ArchName", "mod:Cls")``.

    `registry` is ember.registry.ModelRegistry; the name is the HF config's architecture.
    """


@hookspec
def ember_register_executors(registry, api_version):  # type: ignore[no-untyped-def]
    """Register executors (what runs the model for the engine core):
    ``registry.register_executor(name, "mod:Cls")``.

    `registry` is ember.registry.ExecutorRegistry; "uni" (in-process) is built in. Added in plugin
    API v1 without a version bump: a new hook breaks no existing plugin.
    """


@hookspec
def ember_register_logits_processors(registry, api_version):  # type: ignore[no-untyped-def]
    """Register logits processors: ``registry.register_logits_processor(name, "mod:Cls")``.

    `registry` is ember.registry.LogitsProcessorRegistry; a request selects one by name with
    ``SamplingParams(extra_args={name: args})``. Added in plugin API v1 without a version bump.
    """


@hookspec
def ember_register_grammar_backends(registry, api_version):  # type: ignore[no-untyped-def]
    """Register grammar backends (structured outputs):
    ``registry.register_grammar_backend(name, "mod:Cls")``.

    `registry` is ember.registry.GrammarBackendRegistry; the class implements
    ember.structured_output.interface.StructuredOutputBackend, and an engine uses it with
    ``structured_outputs_config={"backend": name}``. Added in plugin API v1 without a version bump.
    """


@hookspec
def ember_register_tool_parsers(registry, api_version):  # type: ignore[no-untyped-def]
    """Register tool-call parsers: ``registry.register_tool_parser(name, "mod:Cls")``.

    `registry` is ember.registry.ToolParserRegistry; the class subclasses
    ember.tool_parsers.ToolParser, and a server uses it with ``--tool-call-parser NAME``.
    Added in plugin API v1 without a version bump.
    """


@hookspec
def ember_register_reasoning_parsers(registry, api_version):  # type: ignore[no-untyped-def]
    """Register reasoning parsers: ``registry.register_reasoning_parser(name, "mod:Cls")``.

    `registry` is ember.registry.ReasoningParserRegistry; the class subclasses
    ember.reasoning.ReasoningParser, and a server uses it with ``--reasoning-parser NAME``.
    Added in plugin API v1 without a version bump.
    """


@hookspec
def ember_register_poolers(registry, api_version):  # type: ignore[no-untyped-def]
    """Register poolers: ``registry.register_pooler(name, "mod:function")``.

    `registry` is ember.registry.PoolerRegistry; the function maps the packed last hidden states
    and an ember.pooling.batch.PoolingBatch to one vector per prompt, and a pooling model uses it
    when its checkpoint names the mode. Added in plugin API v1 without a version bump.
    """


# Hook name -> registry key in ember.registry.REGISTRIES, in the order hooks are called.
HOOKS: dict[str, str] = {
    "ember_register_platforms": "platforms",
    "ember_register_attention_backends": "attention_backends",
    "ember_register_quantization_methods": "quantization_methods",
    "ember_register_models": "models",
    "ember_register_executors": "executors",
    "ember_register_logits_processors": "logits_processors",
    "ember_register_grammar_backends": "grammar_backends",
    "ember_register_tool_parsers": "tool_parsers",
    "ember_register_reasoning_parsers": "reasoning_parsers",
    "ember_register_poolers": "poolers",
}
