"""Benchmarks behind `ember bench` (throughput, latency, serve)."""
