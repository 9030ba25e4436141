"""CpuVariantBackend: ember's SDPA backend with the attention math in float32 whatever the model
dtype (the KV cache stays in the model dtype): more exact bfloat16/float16 results on CPUs."""

import torch

from ember.attention_backends.sdpa import SdpaBackend, SdpaImpl


class CpuVariantImpl(SdpaImpl):
    def forward(self, query, key, value, kv_cache, metadata):
        if query.dtype == torch.float32:
            return super().forward(query, key, value, kv_cache, metadata)
        out = super().forward(query.float(), key.float(), value.float(), kv_cache, metadata)
        return out.to(query.dtype)


class CpuVariantBackend(SdpaBackend):
    name = "cpu_variant_sdpa"

    @classmethod
    def impl_cls(cls):
        return CpuVariantImpl
