"""GraphRunner: decode steps replayed from device graphs captured per padded batch size.

A pure-decode step (every request has one new token) with at most `max_batch_size` requests is
padded up to the next captured size; its inputs are copied into persistent device buffers that
the graph reads, and the graph replays the whole model forward in one launch. Padded rows write
no KV (slot -1) and attend to nothing (seq_len 0). Capture and replay go through the platform
(graph_memory_pool, capture_graph, synchronize), which captures only when it declares
`supports_cuda_graphs`. Any attention backend that declares `supports_cuda_graphs` works: its
prepare_graph_capture hook sizes its persistent workspaces before capture, and its
prepare_for_replay hook sees each replayed step's metadata before the graph runs.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ember.attention_backends.base import AttentionBackend, AttentionMetadata
from ember.platforms.base import GraphCaptureRefused
from ember.worker.input_batch import FlatBatch

if TYPE_CHECKING:
    from ember.platforms.base import Graph

logger = logging.getLogger("ember")


@contextlib.contextmanager
def _collector_paused(collect: bool) -> Iterator[None]:
    """Python's cyclic garbage collector off while graphs are captured, after one collection
    (``collect``: on a device, not on the host, where it only costs 0.1-0.2 s of a load).

    A collection during capture runs the finalizers of whatever it frees (an engine shut down
    earlier in the process, say), and a device call they make on the capturing stream's
    behalf, such as freeing pinned memory, invalidates the capture."""
    if collect:
        gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def capture_sizes(max_batch_size: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch_size]
    sizes += list(range(16, max_batch_size + 1, 16))
    if sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sizes


def _overrides_replay_hook(backend: type[AttentionBackend]) -> bool:
    hook = getattr(backend.prepare_for_replay, "__func__", None)
    return hook is not AttentionBackend.prepare_for_replay.__func__  # type: ignore[attr-defined]


class GraphRunner:
    def __init__(self, runner, max_batch_size: int, max_blocks_per_req: int) -> None:
        self.runner = runner
        self.platform = runner.platform
        self.sizes = capture_sizes(max_batch_size)
        self.max_batch_size = self.sizes[-1]
        device = runner.device
        n = self.max_batch_size

        def zeros(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = zeros(n, dtype=torch.int64)
        self.positions = zeros(n, dtype=torch.int64)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = zeros(n, dtype=torch.int32)
        self.block_table = zeros(n, max_blocks_per_req, dtype=torch.int32)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, Graph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        # The base hook does nothing: skip building a replay's metadata for backends that keep it.
        self.calls_replay_hook = _overrides_replay_hook(runner.attn_backend)

    def _metadata(self, bs: int, max_seq_len: int, seq_lens_cpu: list[int],
                  num_actual_tokens: int) -> AttentionMetadata:
        return AttentionMetadata(
            num_actual_tokens=num_actual_tokens,
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_table=self.block_table[:bs],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_start_loc_cpu=list(range(bs + 1)),
            seq_lens_cpu=seq_lens_cpu,
            num_decode_tokens=bs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        from ember.layers.attention import ForwardContext

        runner, platform = self.runner, self.platform
        backend = runner.attn_backend
        backend.prepare_graph_capture(self.max_batch_size, self.block_table.shape[1], runner.device)
        max_len = runner.model_config.max_model_len
        start = time.perf_counter()
        self.seq_lens.fill_(1)  # capture-time values: every row reads one (junk) key
        pool = platform.graph_memory_pool()
        host = platform.device_is_host()
        with _collector_paused(collect=not host):
            try:
                # Largest first: on a GPU smaller graphs reuse its memory pool.
                for bs in reversed(self.sizes):
                    metadata = self._metadata(bs, max_len, [1] * bs, bs)
                    ctx = ForwardContext(attn_metadata=metadata, kv_caches=runner.kv_caches)
                    args = (self.input_ids[:bs], self.positions[:bs], ctx)
                    if not host or bs == self.sizes[-1]:
                        # Warm-up: compiles kernels (per size on a GPU), fills lazy caches.
                        runner.model(*args)
                    platform.synchronize()
                    self.graphs[bs], self.outputs[bs] = platform.capture_graph(
                        lambda args=args: runner.model(*args), pool
                    )
            except GraphCaptureRefused as exc:
                self.graphs.clear()
                self.outputs.clear()
                logger.info("decode steps run eagerly: the platform cannot capture this "
                            "model's forward (%s)", exc)
        platform.synchronize()
        self.seq_lens.zero_()
        self.capture_seconds = time.perf_counter() - start
        if not self.graphs:
            return
        logger.info("captured %d decode graphs (batch 1..%d) in %.1f s", len(self.sizes),
                    self.max_batch_size, self.capture_seconds)

    def can_run(self, batch: FlatBatch) -> bool:
        num_reqs = len(batch.req_ids)
        return (
            bool(self.graphs)
            and batch.num_decode_tokens == num_reqs
            and num_reqs <= self.max_batch_size
            and batch.block_table.shape[1] <= self.block_table.shape[1]
        )

    def run(self, batch: FlatBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """Replay the graph for this pure-decode batch; input_ids are already on the device."""
        self.stage_inputs(batch)
        return self.replay(batch, input_ids)

    def stage_inputs(self, batch: FlatBatch) -> None:
        """Queue the copies of the batch's inputs other than its token ids into the graph's
        buffers (behind the step in flight, which read them)."""
        n = len(batch.req_ids)
        bs = next(s for s in self.sizes if s >= n)
        stage = self.runner.stager.to_device
        width = batch.block_table.shape[1]
        self.positions[:n].copy_(stage("positions", batch.positions, torch.int64), non_blocking=True)
        self.slot_mapping[:n].copy_(stage("slot_mapping", batch.slot_mapping, torch.int64),
                                    non_blocking=True)
        self.seq_lens[:n].copy_(stage("seq_lens", batch.seq_lens, torch.int32), non_blocking=True)
        self.block_table[:n, :width].copy_(stage("block_table", batch.block_table, torch.int32),
                                           non_blocking=True)
        if bs > n:  # padding rows: no KV write, no keys to read
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(0)

    def replay(self, batch: FlatBatch, input_ids: torch.Tensor) -> torch.Tensor:
        """Replay the graph (stage_inputs first) on input_ids, already on the device."""
        n = len(batch.req_ids)
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        if self.calls_replay_hook:
            seq_lens = batch.seq_lens.tolist() + [0] * (bs - n)
            self.runner.attn_backend.prepare_for_replay(
                self._metadata(bs, int(batch.seq_lens.max()), seq_lens, n)
            )
        self.graphs[bs].replay()
        return self.outputs[bs][:n]
