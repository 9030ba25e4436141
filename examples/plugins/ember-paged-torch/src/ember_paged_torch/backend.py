"""PagedTorchBackend: paged attention in plain torch ops, all requests of a step in one batch.

Unlike ember's SDPA backend (a loop over prefills, SDPA kernels), this pads every request to the
step's longest query and context, gathers each request's keys/values through its block table,
and does the masked softmax explicitly in float32. It is simple rather than fast: a worked
example of the backend contract (ember.attention_backends.base) for plugin authors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.attention_backends.base import AttentionBackend, AttentionImpl, AttentionMetadata


@dataclass
class _Plan:
    """Per-step index tensors, built once and shared by every layer."""

    token_index: torch.Tensor  # [B, max_q] row of each padded query in the flat batch
    query_valid: torch.Tensor  # [B, max_q] bool
    query_pos: torch.Tensor  # [B, max_q] absolute position of each query
    seq_lens: torch.Tensor  # [B]
    max_kv: int


def _plan(md: AttentionMetadata) -> _Plan:
    device = md.slot_mapping.device
    qsl = md.query_start_loc_cpu
    q_lens = [qsl[i + 1] - qsl[i] for i in range(md.num_reqs)]
    max_q = max(q_lens)
    starts = torch.tensor(qsl[:-1], device=device)[:, None]
    offsets = torch.arange(max_q, device=device)[None]
    lens = torch.tensor(q_lens, device=device)[:, None]
    seq = torch.tensor(md.seq_lens_cpu, device=device)
    valid = offsets < lens
    return _Plan(
        token_index=torch.where(valid, starts + offsets, 0),
        query_valid=valid,
        query_pos=seq[:, None] - lens + offsets,
        seq_lens=seq,
        max_kv=max(md.seq_lens_cpu),
    )


class PagedTorchImpl(AttentionImpl):
    def forward(self, query, key, value, kv_cache, metadata):
        plan = metadata.backend_data
        if not isinstance(plan, _Plan):
            plan = metadata.backend_data = _plan(metadata)
        n = metadata.num_actual_tokens
        # 1. store the new keys/values at their slots (-1 = padding: skipped)
        slots = metadata.slot_mapping[:n]
        keep = slots >= 0
        flat = kv_cache.view(2, -1, self.num_kv_heads, self.head_size)
        flat[0][slots[keep]] = key[:n][keep].to(kv_cache.dtype)
        flat[1][slots[keep]] = value[:n][keep].to(kv_cache.dtype)
        # 2. gather each request's context through its block table: [B, max_kv, kvh, d]
        block_size = kv_cache.shape[2]
        nblk = -(-plan.max_kv // block_size)
        blocks = metadata.block_table[:, :nblk].long()
        k = kv_cache[0][blocks].flatten(1, 2)[:, : plan.max_kv].float()
        v = kv_cache[1][blocks].flatten(1, 2)[:, : plan.max_kv].float()
        group = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(group, dim=2)  # query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=2)
        # 3. masked attention of the padded queries: [B, H, max_q, max_kv]
        q = query[plan.token_index].float()  # [B, max_q, H, d]
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.scale
        if self.logits_soft_cap:
            scores = self.logits_soft_cap * torch.tanh(scores / self.logits_soft_cap)
        kpos = torch.arange(plan.max_kv, device=q.device)[None, None, :]
        qpos = plan.query_pos[:, :, None]
        mask = (kpos <= qpos) & (kpos < plan.seq_lens[:, None, None])
        if self.sliding_window:
            mask &= qpos - kpos < self.sliding_window
        mask &= plan.query_valid[:, :, None]
        scores = scores.masked_fill(~mask[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # padded query rows: all masked
        out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
        # 4. scatter the valid rows back to the flat batch
        result = query.new_zeros(query.shape[0], self.num_heads * self.head_size)
        rows = plan.token_index[plan.query_valid]
        result[rows] = out[plan.query_valid].flatten(1).to(query.dtype)
        return result


class PagedTorchBackend(AttentionBackend):
    name = "paged_torch"
    supports_cuda_graphs = False

    @classmethod
    def impl_cls(cls):
        return PagedTorchImpl

    @classmethod
    def build_metadata(cls, metadata: AttentionMetadata) -> AttentionMetadata:
        metadata.backend_data = _plan(metadata)
        return metadata
