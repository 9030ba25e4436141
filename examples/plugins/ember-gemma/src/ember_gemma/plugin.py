"""Registration only: the architecture name (config.json "architectures") and where the class
lives. ember imports ember_gemma.model only when a Gemma checkpoint is loaded."""

from ember.plugins import hookimpl


@hookimpl
def ember_register_models(registry):
    registry.register_model("GemmaForCausalLM", "ember_gemma.model:GemmaForCausalLM")
