"""Fails at import, like a plugin whose dependency is missing."""

import ember_dependency_that_is_not_installed  # noqa: F401

from ember.plugins import hookimpl


@hookimpl
def ember_register_models(registry):
    registry.register_model("BrokenForCausalLM", "ember_broken_plugin.model:BrokenForCausalLM")
