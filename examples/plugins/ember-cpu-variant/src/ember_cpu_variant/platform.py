"""CpuVariantPlatform: ember's CPU platform, preferring its own attention backend."""

from ember.platforms.cpu import CpuPlatform
from ember_cpu_variant.probe import available


class CpuVariantPlatform(CpuPlatform):
    name = "cpu_variant"
    device_type = "cpu"
    preferred_attention_backends = ["cpu_variant_sdpa", "sdpa"]

    @classmethod
    def is_available(cls):
        return available()[0]

    @classmethod
    def unavailable_reason(cls):
        ok, reason = available()
        return None if ok else reason
