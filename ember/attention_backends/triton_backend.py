"""The "triton" attention backend: Triton KV store, paged decode (split-KV) and paged prefill.

A step's batch has its decode requests first (``num_decode_tokens`` of them, one token each);
they go to the split-KV decode kernel, the rest (prefills, chunked continuations, prefix hits) to
the prefill kernel. Everything in ``forward`` is graph-safe: no host syncs, and the only
allocations have sizes fixed by the batch shape (the split workspace is persistent and sized for
the largest graph batch once ``prepare_graph_capture`` has run).

The KV cache may be float8_e4m3fn (``kv_cache_dtype="fp8"``): the kernels store K / k_scale and
V / v_scale and read them back through the same per-tensor scales (``TritonImpl.k_scale`` /
``v_scale``, 1.0 unless set: vLLM's default when a checkpoint brings none).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, ClassVar

from ember import kernels
from ember.attention_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata

if TYPE_CHECKING:
    import torch

# The ember.kernels.buffers purpose of the split-KV decode workspace.
SPLIT_WORKSPACE = "triton.decode_split_workspace"


# Cached: every layer asks the same question each step, and the answers are pure functions.
@functools.lru_cache(maxsize=1024)
def _num_splits(batch: int, num_kv_heads: int, head_size: int, max_seq_len: int | None,
                device: torch.device, cache_itemsize: int) -> int:
    """The splits paged_decode_attention would choose itself for this batch over a cache of
    ``cache_itemsize`` bytes an element (the same policy entry)."""
    decode = kernels.decode_splits
    policy = decode.default_config(head_size, tuning=kernels.tuning.tuning_for(device),
                                   cache_itemsize=cache_itemsize)
    return decode.choose_num_splits(batch, num_kv_heads, max_seq_len, policy,
                                    kernels.launch.num_sms(device))


@functools.lru_cache(maxsize=64)
def _graph_workspace_numel(graph_batch: int, num_heads: int, num_kv_heads: int, head_size: int,
                           device: torch.device, cache_itemsize: int) -> int:
    return max(
        kernels.decode_splits.decode_workspace_numel(
            b, num_heads, head_size,
            _num_splits(b, num_kv_heads, head_size, None, device, cache_itemsize))
        for b in range(1, graph_batch + 1)
    )


class TritonImpl(AttentionImpl):
    """Per-layer attention through ember.kernels' store_kv, decode_attention and
    prefill_attention (loaded on first use: listing or resolving backends imports no triton)."""

    # Per-tensor scales of an fp8 KV cache (unused with a float cache).
    k_scale: float = 1.0
    v_scale: float = 1.0

    def _decode_splits(self, batch: int, max_seq_len: int | None, device: torch.device,
                       cache_itemsize: int) -> int:
        return _num_splits(batch, self.num_kv_heads, self.head_size, max_seq_len, device,
                           cache_itemsize)

    def _workspace(self, batch: int, num_splits: int, device: torch.device,
                   cache_itemsize: int) -> torch.Tensor | None:
        if num_splits == 1:
            return None
        need = kernels.decode_splits.decode_workspace_numel(batch, self.num_heads,
                                                               self.head_size, num_splits)
        graph_batch = TritonBackend.graph_max_batch_size
        if graph_batch:
            # Sized once for every graph batch size, so capture never has to grow the buffer.
            need = max(need, _graph_workspace_numel(graph_batch, self.num_heads,
                                                    self.num_kv_heads, self.head_size, device,
                                                    cache_itemsize))
        return TritonBackend.workspace(need, device)

    def writes_quantized(self, dtype: torch.dtype) -> bool:
        # int8 (a 4-bit o_proj's integer GEMV): the split merge quantizes each head as one of
        # int8_act's groups.
        import torch

        return dtype == torch.int8 and self.head_size == kernels.int8_act.GROUP

    def fuses_rotary(self, rotary_dim: int) -> bool:
        # The decode kernel rotates q and the step's key as it loads them (a kernel fewer a
        # layer); the rotary kernel rotates the prefill tokens.
        return rotary_dim == self.head_size == kernels.launch.head_pad(self.head_size)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        quantize: torch.dtype | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        import torch

        num_tokens = query.shape[0]
        q = query.view(num_tokens, self.num_heads, self.head_size)
        k = key.view(num_tokens, self.num_kv_heads, self.head_size)
        v = value.view(num_tokens, self.num_kv_heads, self.head_size)
        num_decodes = metadata.num_decode_tokens
        if rotary is not None and num_tokens > num_decodes:
            cos, sin = rotary
            kernels.rotary.rotary_inplace(q[num_decodes:], k[num_decodes:], cos[num_decodes:],
                                          sin[num_decodes:], self.head_size)
        # The decode kernel writes the decode rows' K/V itself (one kernel fewer per layer);
        # the store kernel writes the rest.
        if num_tokens > num_decodes:
            kernels.store_kv.store_kv(k[num_decodes:], v[num_decodes:], kv_cache,
                                      metadata.slot_mapping[num_decodes:], self.k_scale,
                                      self.v_scale)

        out = torch.empty(
            num_tokens, self.num_heads * self.head_size, dtype=query.dtype, device=query.device
        )
        out3 = out.view(num_tokens, self.num_heads, self.head_size)
        int8_out = None  # (q, scales, sums) where the decode kernels write the output in int8
        num_reqs = metadata.num_reqs
        window = self.sliding_window
        cap = self.logits_soft_cap
        if num_decodes > 0:
            # Pure-decode batches may be graph captured: choose splits from the batch alone so
            # the captured grid stays good for whatever lengths the replays bring. Eager runs
            # (enforce_eager, or batches past the largest graph) choose the same way, so they
            # round exactly as replays do and give the same tokens.
            max_seq_len = None if num_reqs == num_decodes else metadata.max_seq_len
            itemsize = kv_cache.element_size()
            splits = self._decode_splits(num_decodes, max_seq_len, query.device, itemsize)
            if quantize is not None and num_tokens == num_decodes and splits > 1:
                int8_out = kernels.int8_act.empty_int8_rows(num_tokens, out.shape[1],
                                                            query.device)
            kernels.decode_attention.paged_decode_attention(
                q[:num_decodes],
                kv_cache,
                metadata.seq_lens[:num_decodes],
                metadata.block_table[:num_decodes],
                self.scale,
                window,
                out3[:num_decodes],
                num_splits=splits,
                logits_soft_cap=cap,
                workspace=self._workspace(num_decodes, splits, query.device, itemsize),
                new_kv=(k[:num_decodes], v[:num_decodes], metadata.slot_mapping[:num_decodes]),
                k_scale=self.k_scale,
                v_scale=self.v_scale,
                int8_out=int8_out,
                rotary=None if rotary is None else (rotary[0][:num_decodes],
                                                    rotary[1][:num_decodes]),
            )
            if int8_out is not None:
                return int8_out
        if num_reqs > num_decodes:
            # query_start_loc holds absolute token offsets, so slicing it keeps pointing at the
            # prefill tokens of the full q/out tensors.
            kernels.prefill_attention.paged_prefill_attention(
                q,
                kv_cache,
                metadata.query_start_loc[num_decodes:],
                metadata.seq_lens[num_decodes:],
                metadata.block_table[num_decodes:],
                metadata.max_query_len,
                self.scale,
                window,
                out3,
                logits_soft_cap=cap,
                k_scale=self.k_scale,
                v_scale=self.v_scale,
            )
        return out


class TritonBackend(AttentionBackend):
    """Paged attention in Triton; works under CUDA graphs (decode) and TRITON_INTERPRET=1."""

    name: ClassVar[str] = "triton"
    supports_cuda_graphs: ClassVar[bool] = True
    graph_max_batch_size: ClassVar[int] = 0

    @classmethod
    def impl_cls(cls) -> type[AttentionImpl]:
        return TritonImpl

    @classmethod
    def prepare_graph_capture(cls, max_batch_size: int, max_blocks_per_req: int, device) -> None:
        cls.graph_max_batch_size = max(cls.graph_max_batch_size, max_batch_size)

    @classmethod
    def workspace(cls, numel: int, device: torch.device) -> torch.Tensor:
        """The device's split workspace: one persistent fp32 buffer of at least ``numel``
        elements (grown, never shrunk), shared by all layers (they run one after another)."""
        import torch

        return kernels.buffers.scratch_buffer(SPLIT_WORKSPACE, numel, torch.float32, device)
