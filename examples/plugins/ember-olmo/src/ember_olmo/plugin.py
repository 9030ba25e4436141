"""Registration only: the architecture name (config.json "architectures") and where the class
lives. ember imports ember_olmo.model only when an OLMo checkpoint is loaded."""

from ember.plugins import hookimpl


@hookimpl
def ember_register_models(registry):
    registry.register_model("OlmoForCausalLM", "ember_olmo.model:OlmoForCausalLM")
