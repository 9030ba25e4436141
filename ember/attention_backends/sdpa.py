"""The torch SDPA attention backend: the correctness reference and the CPU production backend.

One step does three things, following the contract in ``base.py``:

1. store the new keys/values into the paged cache at ``slot_mapping`` (slots < 0 are skipped);
2. decodes (the leading ``num_decode_tokens`` requests, one query each) in ONE batched SDPA call:
   every request's blocks are gathered into a padded ``[B, kv_heads, Lmax, D]`` tensor and a
   boolean mask hides the padding (and keys outside the sliding window);
3. prefill chunks one request at a time, causal with an offset (query i of a chunk of length q
   sits at position ``seq_len - q + i``).

Per-step work that every layer would repeat (block ids to gather, masks) is computed once per
step and kept in ``metadata.backend_data`` (a ``SdpaPlan``), keyed by block size and window.

On the CPU with a float32 cache, steps 1 and 2 are native calls instead
(ember.kernels.cpu.layer_ops): the store in one call, and decode attention read straight from
the cache through the block table, with no gather, no mask and no padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ember.attention_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata
from ember.kernels.buffers import release_scratch, scratch_buffer
from ember.kernels.cpu import layer_ops

# Gathered decode K/V can be tens of MB per layer; on the CPU a fresh allocation that large is
# an mmap whose pages fault in on every layer, which costs as much as the copy itself. Layers run
# one after another, so one grow-only scratch buffer serves them all. Other devices have a
# caching allocator already (and a hidden persistent buffer would upset memory profiling).
# An inference-mode tensor cannot be written outside inference mode: one buffer per mode.
_GATHER_PURPOSES = {True: "sdpa.gather.inference_mode", False: "sdpa.gather"}


def release_workspaces() -> None:
    """Drop the CPU gather buffers (they are re-created on the next decode)."""
    for purpose in _GATHER_PURPOSES.values():
        release_scratch(purpose)


def _workspace(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    purpose = _GATHER_PURPOSES[torch.is_inference_mode_enabled()]
    return scratch_buffer(purpose, numel, dtype, device)[:numel]


@dataclass
class _DecodePlan:
    block_ids: torch.Tensor  # [B * blocks_per_req] int64, the blocks to gather, request-major
    blocks_per_req: int
    mask: torch.Tensor  # [B, 1, 1, blocks_per_req * block_size] bool, True = key visible


@dataclass
class _PrefillReq:
    req: int
    q_start: int
    q_end: int
    seq_len: int


@dataclass
class SdpaPlan:
    """Step-level data shared by every layer; the per-layer parts are built on first use.

    Building it does no tensor work (slicing only), so that a captured CPU decode graph, whose
    forward may only make native calls, can build it; the torch path's parts are computed on
    first use."""

    metadata: AttentionMetadata
    slots: torch.Tensor  # [num_actual_tokens] int64 cache slots, < 0 = padding (not stored)
    prefills: list[_PrefillReq]
    cpu_ops: bool = False  # the step's tensors suit ember.kernels.cpu.layer_ops
    consumers: set[int] = field(default_factory=set)  # ids of the impls that used this plan
    _writes: tuple[torch.Tensor, torch.Tensor | None] | None = None
    _decode: dict[tuple[int, int | None], _DecodePlan] = field(default_factory=dict)
    _blocks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    _masks: dict[tuple[int, int | None], torch.Tensor | None] = field(default_factory=dict)

    @classmethod
    def build(cls, md: AttentionMetadata) -> SdpaPlan:
        slots = md.slot_mapping[: md.num_actual_tokens]
        if slots.dtype != torch.int64:
            slots = slots.long()
        qsl = md.query_start_loc_cpu
        num_decode_reqs = md.num_decode_tokens  # one token per decode request
        prefills = [
            _PrefillReq(i, qsl[i], qsl[i + 1], md.seq_lens_cpu[i])
            for i in range(num_decode_reqs, md.num_reqs)
            if qsl[i + 1] > qsl[i]
        ]
        cpu_ops = (md.seq_lens.device.type == "cpu"
                   and md.block_table.dtype == md.seq_lens.dtype == torch.int32
                   and md.block_table.stride(1) == 1 and md.seq_lens.is_contiguous())
        return cls(md, slots, prefills, cpu_ops)

    def writes(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(slots of the tokens to store, their rows in key/value; None = rows 0..n-1)."""
        if self._writes is None:
            slots, rows = self.slots, None
            valid = slots >= 0
            if not bool(valid.all()):
                rows = valid.nonzero().squeeze(1)
                slots = slots.index_select(0, rows)
            self._writes = (slots, rows)
        return self._writes

    def decode_plan(self, block_size: int, window: int | None) -> _DecodePlan:
        key = (block_size, window)
        if key not in self._decode:
            self._decode[key] = self._build_decode(block_size, window)
        return self._decode[key]

    def _build_decode(self, block_size: int, window: int | None) -> _DecodePlan:
        md = self.metadata
        num = md.num_decode_tokens
        seq_cpu = md.seq_lens_cpu[:num]
        seq = md.seq_lens[:num].long()
        device = seq.device
        if window is None:
            first = torch.zeros_like(seq)
            nb = max((s + block_size - 1) // block_size for s in seq_cpu)
        else:
            # With a window only the blocks holding the last `window` keys are read.
            first = (seq - window).clamp(min=0) // block_size
            nb = max(
                (s + block_size - 1) // block_size - max(s - window, 0) // block_size
                for s in seq_cpu
            )
        cols = first[:, None] + torch.arange(nb, device=device)[None]
        table = md.block_table[:num]
        # Columns past a request's last block read a harmless block (table padding, clamped to
        # be a valid id) whose keys the mask hides, as their positions are >= seq_len.
        ids = table.gather(1, cols.clamp(max=table.shape[1] - 1)).long().clamp(min=0)
        kpos = (cols[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)
        mask = kpos < seq[:, None]
        if window is not None:
            mask &= kpos >= (seq - window)[:, None]
        return _DecodePlan(ids.flatten(), nb, mask[:, None, None])

    def context_blocks(self, p: _PrefillReq, block_size: int) -> torch.Tensor:
        key = (p.req, block_size)
        if key not in self._blocks:
            nb = (p.seq_len + block_size - 1) // block_size
            self._blocks[key] = self.metadata.block_table[p.req, :nb].long()
        return self._blocks[key]

    def prefill_mask(self, p: _PrefillReq, window: int | None) -> torch.Tensor | None:
        """[q_len, seq_len] bool mask, or None when plain causal (is_causal) is exact."""
        q_len = p.q_end - p.q_start
        if q_len == p.seq_len and window is None:
            return None
        key = (p.req, window)
        if key not in self._masks:
            device = self.metadata.seq_lens.device
            qpos = torch.arange(p.seq_len - q_len, p.seq_len, device=device)[:, None]
            kpos = torch.arange(p.seq_len, device=device)[None]
            mask = kpos <= qpos
            if window is not None:
                mask &= (qpos - kpos) < window
            self._masks[key] = mask
        return self._masks[key]


def _attend(
    q: torch.Tensor,  # [..., Hq, Lq, D]
    k: torch.Tensor,  # [..., Hkv, Lk, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
    soft_cap: float | None,
) -> torch.Tensor:
    if soft_cap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
            enable_gqa=q.shape[-3] != k.shape[-3],
        )
    # SDPA has no soft-capping: spell the attention out (rarely used, so kept simple).
    rep = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    s = soft_cap * torch.tanh(s / soft_cap)
    if is_causal:
        mask = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(s.softmax(-1).to(v.dtype), v)


class SdpaImpl(AttentionImpl):
    """Paged attention through ``torch.nn.functional.scaled_dot_product_attention``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.use_cpu_ops = layer_ops.configured()

    @staticmethod
    def _cpu_layout(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    kv_cache: torch.Tensor) -> bool:
        """This layer's tensors as the native ops take them (the step's part: SdpaPlan)."""
        return (key.dtype == value.dtype == kv_cache.dtype == torch.float32
                and kv_cache.is_contiguous() and layer_ops.heads_contiguous(query)
                and layer_ops.heads_contiguous(key) and layer_ops.heads_contiguous(value))

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        plan = self._plan(metadata)
        n = metadata.num_actual_tokens
        out = query.new_empty(query.shape[0], self.num_heads * self.head_size)
        if n < out.shape[0]:
            out[n:] = 0  # padding rows: defined values are cheaper to debug than garbage
        num_decode = metadata.num_decode_tokens
        if (self.use_cpu_ops and plan.cpu_ops and layer_ops.takes(query)
                and self._cpu_layout(query, key, value, kv_cache)):
            if num_decode > 0:  # the store and decode attention in one call
                layer_ops.decode_attention(
                    query[:num_decode], kv_cache, metadata.block_table[:num_decode],
                    metadata.seq_lens[:num_decode], out[:num_decode], self.scale,
                    self.sliding_window, self.logits_soft_cap, (key, value, plan.slots))
            else:
                layer_ops.store_kv(key, value, kv_cache, plan.slots)
        else:
            self._store_kv(key, value, kv_cache, plan)
            if num_decode > 0:
                self._decode(query, kv_cache, plan, out)
        for p in plan.prefills:
            self._prefill(query, key, value, kv_cache, plan, p, out)
        return out

    def _plan(self, metadata: AttentionMetadata) -> SdpaPlan:
        plan = metadata.backend_data
        # A plan serves each layer once per step. If this layer has used it already, the
        # metadata object is being reused for a new step without build_metadata: rebuild.
        if not (
            isinstance(plan, SdpaPlan)
            and plan.metadata is metadata
            and id(self) not in plan.consumers
        ):
            plan = SdpaPlan.build(metadata)
            if metadata.backend_data is None or isinstance(metadata.backend_data, SdpaPlan):
                metadata.backend_data = plan  # share it with the step's later layers
        plan.consumers.add(id(self))
        return plan

    def _store_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, plan: SdpaPlan
    ) -> None:
        write_slots, rows = plan.writes()
        n = write_slots.shape[0]
        if n == 0:
            return
        # .view (not reshape) so that a non-contiguous cache fails loudly instead of writing
        # into a temporary copy.
        flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_size)
        k = key[:n] if rows is None else key.index_select(0, rows)
        v = value[:n] if rows is None else value.index_select(0, rows)
        flat[0].index_copy_(0, write_slots, k.to(flat.dtype))
        flat[1].index_copy_(0, write_slots, v.to(flat.dtype))

    def _decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, plan: SdpaPlan, out: torch.Tensor
    ) -> None:
        num = plan.metadata.num_decode_tokens
        _, num_blocks, block_size, kvh, d = kv_cache.shape
        dp = plan.decode_plan(block_size, self.sliding_window)
        per_block = block_size * kvh * d
        ws = _workspace(2 * dp.block_ids.numel() * per_block, kv_cache.dtype, kv_cache.device)
        ws = ws.view(2, dp.block_ids.numel(), per_block)
        torch.index_select(kv_cache.view(2, num_blocks, per_block), 1, dp.block_ids, out=ws)
        kv = ws.view(2, num, dp.blocks_per_req * block_size, kvh, d).transpose(2, 3)
        kv = kv.to(query.dtype)
        # GQA by folding each kv head's query group into the query-length axis: one MHA call
        # with kv_heads heads and `group` queries, which beats enable_gqa's broadcast on CPU.
        group = self.num_heads // kvh
        q = query[:num].view(num, kvh, group, d)
        o = _attend(q, kv[0], kv[1], dp.mask, False, self.scale, self.logits_soft_cap)
        out[:num] = o.reshape(num, self.num_heads * d)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: SdpaPlan,
        p: _PrefillReq,
        out: torch.Tensor,
    ) -> None:
        q_len = p.q_end - p.q_start
        q = query[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if q_len == p.seq_len and kv_cache.dtype == key.dtype:
            # No earlier context: the keys are exactly this step's, no need to read the cache.
            k, v = key[p.q_start : p.q_end], value[p.q_start : p.q_end]
        else:
            block_size = kv_cache.shape[2]
            blocks = plan.context_blocks(p, block_size)
            kv = kv_cache.index_select(1, blocks).flatten(1, 2)[:, : p.seq_len]
            k, v = kv[0].to(query.dtype), kv[1].to(query.dtype)
        k = k.transpose(0, 1).unsqueeze(0)  # [1, KVH, seq_len, D]
        v = v.transpose(0, 1).unsqueeze(0)
        mask = plan.prefill_mask(p, self.sliding_window)
        o = _attend(q, k, v, mask, mask is None, self.scale, self.logits_soft_cap)
        out[p.q_start : p.q_end] = o[0].transpose(0, 1).reshape(q_len, -1)


class SdpaBackend(AttentionBackend):
    """Reference backend: exact, portable (any torch device), and the fast path on CPUs."""

    name = "sdpa"
    supports_cuda_graphs = False

    @classmethod
    def impl_cls(cls) -> type[AttentionImpl]:
        return SdpaImpl

    @classmethod
    def build_metadata(cls, metadata: AttentionMetadata) -> AttentionMetadata:
        metadata.backend_data = SdpaPlan.build(metadata)
        return metadata
