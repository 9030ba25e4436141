"""Example ember plugin: AI2's OLMo (v1) architecture, built from ember's layers. Kept empty so
that listing plugins imports nothing but ``ember_olmo.plugin``."""
