"""The attention-backend contract: KV cache layout, per-step metadata, and the impl interface.

Every backend reads the same flat token batch. Tokens of all scheduled requests are concatenated
(request order = batch order); request i owns query tokens
``query_start_loc[i]:query_start_loc[i+1]`` whose absolute positions are
``seq_lens[i] - query_len_i ... seq_lens[i] - 1``. Each token attends causally to every key of its
own request at a position <= its own (within ``sliding_window`` when set). Keys and values of the
new tokens are first written into the paged cache at ``slot_mapping`` (slot = block * block_size +
offset); then attention reads all keys, old and new, through ``block_table``.

KV cache of one layer: a tensor of shape ``[2, num_blocks, block_size, num_kv_heads, head_size]``
(index 0 = keys, 1 = values).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch


@dataclass
class AttentionMetadata:
    """What every backend gets for one step (tensors on the model's device)."""

    num_actual_tokens: int  # tokens in this step (<= len(slot_mapping) when padded for graphs)
    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = padding, write nothing
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [num_reqs] int32, context length after this step's tokens
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    max_query_len: int
    max_seq_len: int
    # Host copies, so backends that need Python ints (e.g. the SDPA loop) never sync the device.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    num_decode_tokens: int = 0  # leading requests with query_len == 1 (the runner orders them first)
    backend_data: object | None = None  # whatever the backend's builder adds

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionImpl:
    """Computes attention for one layer. Built once per layer by the backend."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_size]
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads * head_size]
        raise NotImplementedError

    def writes_quantized(self, dtype: torch.dtype) -> bool:
        """Whether ``forward`` takes ``quantize=dtype``: the output written quantized for a
        quantized layer after it, where the step allows (the tensors of the form that layer's
        ``quantized_input_dtype`` names: for int8, ember.kernels.int8_act's (data, scales,
        sums), which the attention layer hands on as a QuantizedActivation), else the usual
        tensor. False by default; ``forward`` is then never passed ``quantize``."""
        return False

    def fuses_rotary(self, rotary_dim: int) -> bool:
        """Whether ``forward`` takes ``rotary=(cos, sin)``: q and k handed over unrotated with
        the step's per-token tables ([num_tokens, rotary_dim / 2] each, in q's dtype, as
        ``RotaryEmbedding.cos_sin`` makes them), and rotated by ``forward`` before it stores K
        and attends: rotate_half over each head's first ``rotary_dim`` dims, bit for bit
        ember.kernels.rotary's result. False by default; ``forward`` is then never passed
        ``rotary``."""
        return False


class AttentionBackend:
    """A named attention implementation plus its static capabilities."""

    name: ClassVar[str] = ""
    supports_cuda_graphs: ClassVar[bool] = False

    @staticmethod
    def kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    def impl_cls(cls) -> type[AttentionImpl]:
        raise NotImplementedError

    @classmethod
    def build_metadata(cls, metadata: AttentionMetadata) -> AttentionMetadata:
        """Hook to add backend-specific data (plans, workspaces) once per step."""
        return metadata

    # CUDA-graph hooks: backends that support graphs keep persistent buffers sized for
    # max_batch_size, fill them in prepare_for_replay, and must not allocate inside capture.
    @classmethod
    def prepare_graph_capture(cls, max_batch_size: int, max_blocks_per_req: int, device) -> None:
        return None

    @classmethod
    def prepare_for_replay(cls, metadata: AttentionMetadata) -> None:
        return None
