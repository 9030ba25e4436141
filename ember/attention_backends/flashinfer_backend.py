"""The "flashinfer" attention backend: FlashInfer's paged decode and paged prefill wrappers.

FlashInfer kernels need a per-step plan (work partitioning over the batch). The first layer of a
step plans both wrappers (decode for the leading one-token requests, prefill for the rest) and
stores the plan on the step's metadata; every later layer with the same attention settings
(sliding window, soft cap, scale, head geometry) reuses it. Layers with other settings (models that
mix sliding and full attention) get their own plan on their own wrappers. Planning reads host-side
lengths, so this backend runs eagerly (no CUDA graphs yet): the triton backend is the graph path.
KV layout is ember's [2, num_blocks, block_size, kv_heads, head_size], passed to FlashInfer as an
NHD (k_cache, v_cache) tuple without copying. An optional extra: `pip install ember[flashinfer]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from ember.attention_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata

if TYPE_CHECKING:
    import torch

_WORKSPACE_BYTES = 256 << 20
# The ember.kernels.buffers purpose of the float workspace all wrappers share.
FLOAT_WORKSPACE = "flashinfer.float_workspace"


@dataclass
class _Plan:
    decode: Any | None  # a planned BatchDecodeWithPagedKVCacheWrapper
    prefill: Any | None  # a planned BatchPrefillWithPagedKVCacheWrapper


def _paged_indices(metadata: AttentionMetadata, rows: range, page_size: int, device):
    """indptr / indices / last_page_len of `rows` in FlashInfer's CSR page-table format."""
    import numpy as np
    import torch

    seq_lens = np.asarray(metadata.seq_lens_cpu, dtype=np.int64)[rows.start : rows.stop]
    pages = -(-seq_lens // page_size)
    indptr = np.zeros(len(seq_lens) + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    row_of_page = np.repeat(np.arange(rows.start, rows.stop), pages)
    col_of_page = np.arange(indptr[-1]) - np.repeat(indptr[:-1], pages)
    flat = torch.from_numpy(row_of_page * metadata.block_table.shape[1] + col_of_page)
    indices = metadata.block_table.reshape(-1).index_select(0, flat.to(device))
    last = (seq_lens - (pages - 1) * page_size).astype(np.int32)
    return torch.from_numpy(indptr).to(device), indices, torch.from_numpy(last).to(device)


class FlashInferImpl(AttentionImpl):
    def _plan(self, metadata: AttentionMetadata, kv_cache: torch.Tensor, q_dtype) -> _Plan:
        plans = metadata.backend_data
        if not isinstance(plans, dict):
            plans = metadata.backend_data = {}
        # Everything a plan depends on besides the batch (layers may differ in any of it).
        settings = (self.sliding_window, self.logits_soft_cap, self.scale, self.num_heads,
                    self.num_kv_heads, self.head_size)
        if settings in plans:
            return plans[settings]
        import torch

        page_size = kv_cache.shape[2]
        device = kv_cache.device
        num_decodes = metadata.num_decode_tokens
        num_reqs = metadata.num_reqs
        common = dict(window_left=self.sliding_window - 1 if self.sliding_window else -1,
                      logits_soft_cap=self.logits_soft_cap, sm_scale=self.scale,
                      q_data_type=q_dtype, kv_data_type=kv_cache.dtype)
        decode = prefill = None
        if num_decodes:
            decode = FlashInferBackend.wrapper("decode", device, self.num_heads // self.num_kv_heads,
                                               settings)
            indptr, indices, last = _paged_indices(metadata, range(0, num_decodes), page_size, device)
            decode.plan(indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_size,
                        page_size, pos_encoding_mode="NONE", **common)
        if num_reqs > num_decodes:
            prefill = FlashInferBackend.wrapper("prefill", device, 0, settings)
            qsl = metadata.query_start_loc_cpu
            qo = torch.tensor([q - qsl[num_decodes] for q in qsl[num_decodes:]], dtype=torch.int32,
                              device=device)
            indptr, indices, last = _paged_indices(metadata, range(num_decodes, num_reqs), page_size,
                                                   device)
            prefill.plan(qo, indptr, indices, last, self.num_heads, self.num_kv_heads,
                         self.head_size, page_size, causal=True, **common)
        plans[settings] = plan = _Plan(decode, prefill)
        return plan

    def forward(self, query, key, value, kv_cache, metadata: AttentionMetadata):
        import torch

        from ember.kernels.store_kv import store_kv

        n = query.shape[0]
        q = query.view(n, self.num_heads, self.head_size)
        store_kv(key.view(n, self.num_kv_heads, self.head_size),
                 value.view(n, self.num_kv_heads, self.head_size), kv_cache, metadata.slot_mapping)
        plan = self._plan(metadata, kv_cache, q.dtype)
        out = torch.empty(n, self.num_heads, self.head_size, dtype=q.dtype, device=q.device)
        caches = (kv_cache[0], kv_cache[1])
        nd = metadata.num_decode_tokens
        if plan.decode is not None:
            plan.decode.run(q[:nd], caches, out=out[:nd])
        if plan.prefill is not None:
            end = metadata.num_actual_tokens
            plan.prefill.run(q[nd:end], caches, out=out[nd:end])
        return out.view(n, self.num_heads * self.head_size)


class FlashInferBackend(AttentionBackend):
    name: ClassVar[str] = "flashinfer"
    supports_cuda_graphs: ClassVar[bool] = False
    _wrappers: ClassVar[dict[tuple, Any]] = {}

    @classmethod
    def impl_cls(cls) -> type[AttentionImpl]:
        return FlashInferImpl

    @classmethod
    def wrapper(cls, kind: str, device, group_size: int, settings: tuple = ()):
        """One wrapper per kind, device and layer settings (each holds its own plan), all sharing
        one float workspace per device: it is scratch for a run, and runs are serial."""
        key = (kind, str(device), group_size >= 4, settings)
        if key not in cls._wrappers:
            import flashinfer
            import torch

            from ember.kernels.buffers import scratch_buffer

            ws = scratch_buffer(FLOAT_WORKSPACE, _WORKSPACE_BYTES, torch.uint8, device)
            if kind == "decode":
                # Tensor cores pay off once several query heads share a kv head.
                cls._wrappers[key] = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                    ws, "NHD", use_tensor_cores=group_size >= 4)
            else:
                cls._wrappers[key] = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        return cls._wrappers[key]
