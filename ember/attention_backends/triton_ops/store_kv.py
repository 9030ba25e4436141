"""Deprecated alias of ember.kernels.store_kv."""

from ember.kernels.store_kv import store_kv

__all__ = ["store_kv"]
