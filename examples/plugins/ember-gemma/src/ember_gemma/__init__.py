"""Example ember plugin: Google's Gemma (v1) architecture, built from ember's layers. Kept empty
so that listing plugins imports nothing but ``ember_gemma.plugin``."""
