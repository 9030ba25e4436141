"""Quantization methods (looked up by name in QuantizationRegistry) and their contract."""
