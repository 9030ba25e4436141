"""ModelRunner: SchedulerOutput -> flat inputs -> attention metadata -> forward -> sampled tokens.

It runs steps on a model it is given; ember.worker.builder builds it (platform, model, weights,
KV cache size, graphs) and calls its set-up methods once. A step's rows are sampled by
ember.worker.step_sampling.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from ember.attention_backends.base import AttentionBackend, AttentionMetadata
from ember.config import ModelConfig
from ember.core.scheduler_output import GrammarBitmask, SchedulerOutput
from ember.layers.sampler import Sampler
from ember.logits_processors.interface import ProcessorContext
from ember.logits_processors.pipeline import LogitsProcessorSet
from ember.worker.grammar_mask import GrammarMasks
from ember.worker.host_memory import lazily_zeroed_tensor
from ember.worker.in_flight import InFlightStep
from ember.worker.input_batch import (
    BlockTableRows,
    CachedRequestState,
    FlatBatch,
    build_flat_batch,
)
from ember.worker.input_stager import InputStager
from ember.worker.step_sampling import plain_greedy, sample_rows

if TYPE_CHECKING:
    from ember.layers.attention import ForwardContext
    from ember.platforms.base import Platform
    from ember.worker.graph_runner import GraphRunner

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a resolved ModelConfig.dtype name."""
    return _DTYPES[name]


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype,
                         platform: Platform) -> torch.dtype:  # fmt: skip
    """The KV cache's element type for EngineArgs.kv_cache_dtype ("auto": the model's); fp8
    needs a platform that computes with fp8 (on CUDA, compute capability 8.9+)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if not platform.supports_fp8():
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} needs a device with fp8 support "
                         f"(the {platform.name} device here has none; on CUDA, compute "
                         "capability 8.9 or newer)")
    return torch.float8_e4m3fn


class ModelRunner:
    """Owns the model, its KV caches and the per-request state the workers keep between steps."""

    def __init__(
        self,
        model_config: ModelConfig,
        attn_backend: type[AttentionBackend],
        platform: Platform,
        model: torch.nn.Module,
        block_size: int,
    ) -> None:
        self.model_config = model_config
        self.attn_backend = attn_backend
        self.platform = platform
        self.device = platform.device()
        self.model: torch.nn.Module = model
        self.dtype = torch_dtype(model_config.dtype)
        self.kv_dtype = kv_cache_torch_dtype(model_config.kv_cache_dtype, self.dtype, platform)
        self.block_size = block_size
        self.states: dict[str, CachedRequestState] = {}
        self.tables = BlockTableRows()
        self.prompt_logprob_reqs: set[str] = set()  # requests that asked for prompt logprobs
        # Requests whose sampling is more than an argmax; while none run, a step skips the check.
        self.special_sampling_reqs: set[str] = set()
        self.kv_caches: list[torch.Tensor] = []
        self.graph_runner: GraphRunner | None = None
        self.sampler = Sampler()
        self.logits_processors = LogitsProcessorSet(
            ProcessorContext(model_config.vocab_size, self.device))
        self.stager = InputStager(platform)
        self.in_flight: InFlightStep | None = None  # the last launched step
        self.grammar_masks = GrammarMasks(platform, self.device)
        self.compiled = False  # compile_model() ran
        # Set once the warm-up has compiled every graph the steps take (ember.worker.builder):
        # from then on dynamo checks only the guards that tell those graphs apart. A full guard
        # check of the whole model's parameters cost ~1.5 ms a call on the CPU (6% of a
        # default-model decode step).
        self.skip_guards = False

    # ---- set-up (called by ember.worker.builder) ---------------------------------------
    def compile_model(self) -> None:
        """torch.compile the model's whole forward as one graph. Its attention layers are one
        opaque op each (ember.layers.compiled_attention: a backend reads host-side metadata and
        writes the paged KV cache in place, which traced code would bake in), fed the step's
        ForwardContext around each call (``_forward``); inductor fuses everything between."""
        from ember.layers import compiled_attention
        from ember.layers.rotary import RotaryEmbedding

        compiled_attention.prepare(self.model)
        for module in self.model.modules():
            if isinstance(module, RotaryEmbedding):
                module.inv_freq_on(self.device)
            # A module that calls a custom op when traced registers it now (registering
            # inside the trace would break the graph).
            prepare = getattr(module, "prepare_for_compile", None)
            if callable(prepare):
                prepare()
        self.model = torch.compile(self.model, dynamic=True)
        self.compiled = True

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor:
        if not self.compiled:
            return self.model(input_ids, positions, ctx)
        from ember.layers.compiled_attention import forward_context

        with forward_context(ctx), torch.compiler.set_stance(
                "default", skip_guard_eval_unsafe=self.skip_guards):
            return self.model(input_ids, positions, ctx)

    def kv_geometry(self) -> tuple[int, int, int]:
        model = self.model
        return model.num_layers, model.num_kv_heads, model.head_size

    def bytes_per_block(self) -> int:
        num_layers, kv_heads, head_size = self.kv_geometry()
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * num_layers * self.block_size * kv_heads * head_size * itemsize

    def initialize_kv_cache(self, num_blocks: int) -> None:
        num_layers, kv_heads, head_size = self.kv_geometry()
        shape = self.attn_backend.kv_cache_shape(num_blocks, self.block_size, kv_heads, head_size)
        if self.platform.device_is_host():
            self.kv_caches = [lazily_zeroed_tensor(shape, self.kv_dtype)
                              for _ in range(num_layers)]
            return
        self.kv_caches = [
            torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(num_layers)
        ]

    def capture_graphs(self, max_batch_size: int) -> float:
        """Capture decode graphs (the builder checks that platform and backend both support
        them); returns the seconds taken."""
        from ember.worker.graph_runner import GraphRunner

        max_blocks = -(-self.model_config.max_model_len // self.block_size)
        self.graph_runner = GraphRunner(self, max_batch_size, max_blocks)
        self.graph_runner.capture()
        return self.graph_runner.capture_seconds

    @torch.inference_mode()
    def profile_run(self, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        """One forward at the largest step (plus sampling at the largest batch), writing no KV,
        so the platform can measure peak activation memory before sizing the KV cache."""
        from ember.layers.attention import ForwardContext
        from ember.layers.sampling_metadata import build_sampling_metadata
        from ember.sampling_params import SamplingParams

        max_len = self.model_config.max_model_len
        num_tokens = max(max_num_batched_tokens, max_num_seqs)
        lens = [min(max_len, num_tokens - i) for i in range(0, num_tokens, max_len)]
        num_layers, kv_heads, head_size = self.kv_geometry()
        shape = self.attn_backend.kv_cache_shape(1, self.block_size, kv_heads, head_size)
        caches = [torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
                  for _ in range(num_layers)]
        width = -(-max(lens) // self.block_size)
        qsl = np.zeros(len(lens) + 1, dtype=np.int32)
        np.cumsum(lens, out=qsl[1:])
        md = AttentionMetadata(
            num_actual_tokens=num_tokens,
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            query_start_loc=torch.from_numpy(qsl).to(self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            block_table=torch.zeros(len(lens), width, dtype=torch.int32, device=self.device),
            max_query_len=max(lens), max_seq_len=max(lens),
            query_start_loc_cpu=qsl.tolist(), seq_lens_cpu=lens, num_decode_tokens=0,
        )
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        ctx = ForwardContext(self.attn_backend.build_metadata(md), caches)
        hidden = self._forward(ids, positions, ctx)
        logits = self.model.compute_logits(hidden[:max_num_seqs])
        params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=50)] * logits.shape[0]
        rows = [[0]] * logits.shape[0]
        sampling = build_sampling_metadata(params, rows, rows, {}, logits.shape[-1], self.device)
        self.sampler(logits, sampling)
        del caches, hidden, logits

    def _stage(self, name: str, array, dtype: torch.dtype) -> torch.Tensor:
        return self.stager.to_device(name, array, dtype)

    # ---- one step ----------------------------------------------------------------------
    def _update_states(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.states.pop(req_id, None)
            self.tables.remove(req_id)
            self.prompt_logprob_reqs.discard(req_id)
            self.special_sampling_reqs.discard(req_id)
        for req_id in out.preempted_req_ids:
            # Keep the generator so a resumed seeded request continues its random stream.
            state = self.states.get(req_id)
            if state is not None:
                state.num_computed_tokens = 0
                self.tables.set(req_id, [])
        for new in out.new_requests:
            old = self.states.get(new.req_id)
            generator = old.generator if old is not None else self._make_generator(new)
            self.states[new.req_id] = CachedRequestState(
                new.req_id,
                list(new.prompt_token_ids),
                list(new.output_token_ids),
                new.sampling_params,
                new.num_computed_tokens,
                generator,
            )
            self.tables.set(new.req_id, new.block_ids)
            if new.sampling_params.prompt_logprobs is not None:
                self.prompt_logprob_reqs.add(new.req_id)
            # More than an argmax at some step (a processor named in extra_args may become
            # active only later, so naming one is enough):
            params = new.sampling_params
            if params.extra_args or not plain_greedy(params, 0, self.logits_processors):
                self.special_sampling_reqs.add(new.req_id)
        for cached in out.cached_requests:
            state = self.states[cached.req_id]
            self.tables.append(cached.req_id, cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _make_generator(self, new) -> torch.Generator | None:
        seed = new.sampling_params.seed
        if seed is None:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        return generator

    def _metadata(self, batch: FlatBatch) -> AttentionMetadata:
        dev = self._stage

        metadata = AttentionMetadata(
            num_actual_tokens=len(batch.input_ids),
            slot_mapping=dev("slot_mapping", batch.slot_mapping, torch.int64),
            query_start_loc=dev("query_start_loc", batch.query_start_loc, torch.int32),
            seq_lens=dev("seq_lens", batch.seq_lens, torch.int32),
            block_table=dev("block_table", batch.block_table, torch.int32),
            max_query_len=int(batch.query_lens.max()),
            max_seq_len=int(batch.seq_lens.max()),
            query_start_loc_cpu=batch.query_start_loc.tolist(),
            seq_lens_cpu=batch.seq_lens.tolist(),
            num_decode_tokens=batch.num_decode_tokens,
        )
        return self.attn_backend.build_metadata(metadata)

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput,
               before_device: Callable[[], None] | None = None) -> InFlightStep:
        """Build, launch and sample one step without waiting for the device. Tokens sampled by
        the step still in flight (async scheduling) are read from its device tensor.
        ``before_device`` is called once the step's host inputs are built and queued, before
        its first device work that reads the step in flight: the engine core launches that
        step's deferred sampling there, so its bitmask has had the host work as time to come."""
        from ember.layers.attention import ForwardContext

        previous, self.in_flight = self.in_flight, None
        self._update_states(out)
        step = InFlightStep(self.platform)
        if out.is_empty:
            if before_device is not None:
                before_device()
            return step
        batch = build_flat_batch(self.states, out.num_scheduled_tokens, self.block_size,
                                 self.tables)
        self.stager.begin()
        input_ids = self._stage("input_ids", batch.input_ids, torch.int64)
        graph = self.graph_runner is not None and self.graph_runner.can_run(batch)
        if graph:
            self.graph_runner.stage_inputs(batch)  # type: ignore[union-attr]
        # The placeholders' host side too goes before the deferred sampling (it waits for its
        # bitmask); only their device copy must follow it.
        placeholders = (self._stage_placeholders(batch, previous)
                        if len(batch.placeholder_positions) else None)
        if before_device is not None:
            before_device()
        if placeholders is not None:
            self._fill_placeholders(input_ids, placeholders, previous)
        if graph:
            hidden = self.graph_runner.replay(batch, input_ids)  # type: ignore[union-attr]
        else:
            positions = self._stage("positions", batch.positions, torch.int64)
            ctx = ForwardContext(attn_metadata=self._metadata(batch), kv_caches=self.kv_caches)
            hidden = self._forward(input_ids, positions, ctx)
        self._prompt_logprobs(batch, hidden, out, step.result)
        if batch.sample_rows:
            rows, logits = self._sampling_logits(batch, hidden)
            if out.grammar_deferred:  # sampled by finish_sampling, once the bitmask is known
                step.deferred_sampling = (rows, logits, previous)
                # The next step is built before that (ModelRunner.launch's before_device) and
                # takes these tokens as inputs: their places are taken now.
                step.reserve(rows)
            else:
                self._sample(rows, logits, step, previous, out.grammar_bitmask)
        self.stager.end()
        for req_id, num in out.num_scheduled_tokens.items():
            self.states[req_id].num_computed_tokens += num
        self.in_flight = step
        return step

    def _stage_placeholders(self, batch: FlatBatch, previous: InFlightStep | None,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The placeholder tokens' positions in the inputs and their rows in the step in
        flight's samples, on the device."""
        states = batch.states
        pendings = [states[row].pending for row in batch.placeholder_rows]
        if previous is None or not all(p is not None and p[0] is previous for p in pendings):
            raise RuntimeError("a placeholder token does not come from the step in flight")
        src_rows = [p[1] for p in pendings]  # type: ignore[index]
        positions = self._stage("placeholder_positions", batch.placeholder_positions, torch.int64)
        sources = self._stage("placeholder_sources", np.array(src_rows), torch.int64)
        return positions, sources

    def _fill_placeholders(self, input_ids: torch.Tensor,
                           staged: tuple[torch.Tensor, torch.Tensor],
                           previous: InFlightStep) -> None:
        """The step in flight's sampled tokens into the inputs, on the device."""
        if previous.sampled is None:
            raise RuntimeError("the step in flight has not been sampled")
        positions, sources = staged
        input_ids[positions] = previous.sampled[sources]

    def _sampling_logits(self, batch: FlatBatch, hidden: torch.Tensor,
                         ) -> tuple[list[CachedRequestState], torch.Tensor]:
        """The states of the rows that sample this step, and their logits."""
        if len(batch.sample_rows) == len(hidden):  # pure decode: every token samples, in order
            return batch.states, self.model.compute_logits(hidden)
        rows = [batch.states[row] for row in batch.sample_rows]
        indices = self._stage("logits_indices", batch.logits_indices, torch.int64)
        return rows, self.model.compute_logits(hidden[indices])

    @torch.inference_mode()
    def finish_sampling(self, step: InFlightStep, grammar: GrammarBitmask | None) -> None:
        """Sample a step launched with `grammar_deferred`, under its now-known bitmask. Called
        before the next step is launched (that step reads these tokens from the device)."""
        deferred, step.deferred_sampling = step.deferred_sampling, None
        if deferred is not None:
            rows, logits, previous = deferred
            self._sample(rows, logits, step, previous, grammar)

    def _sample(self, rows: list[CachedRequestState], logits: torch.Tensor, step: InFlightStep,
                previous: InFlightStep | None, grammar: GrammarBitmask | None = None) -> None:
        sample_rows(rows, logits, step, previous, grammar, sampler=self.sampler,
                    processors=self.logits_processors, grammar_masks=self.grammar_masks,
                    device=self.device, any_special=bool(self.special_sampling_reqs))

    def _prompt_logprobs(
        self, batch: FlatBatch, hidden: torch.Tensor, out: SchedulerOutput, result
    ) -> None:
        if not self.prompt_logprob_reqs:
            return
        from ember.layers.sampler import compute_prompt_logprobs

        for row, req_id in enumerate(batch.req_ids):
            if req_id not in self.prompt_logprob_reqs:
                continue
            state = self.states[req_id]
            k = state.sampling_params.prompt_logprobs
            num_prompt = len(state.prompt_token_ids)
            start = state.num_computed_tokens
            if k is None or start >= num_prompt:
                continue
            # Hidden state at prompt position p predicts prompt token p + 1.
            end = min(start + int(batch.query_lens[row]), num_prompt - 1)
            entries: list[tuple[list[int], list[float], int]] = []
            if end > start:
                offset = int(batch.query_start_loc[row])
                logits = self.model.compute_logits(
                    hidden[offset : offset + end - start]
                )
                targets = torch.tensor(
                    state.prompt_token_ids[start + 1 : end + 1], device=self.device
                )
                lp = compute_prompt_logprobs(logits, targets, k)
                ids, values, ranks = (
                    lp.logprob_token_ids.tolist(), lp.logprobs.tolist(),
                    lp.selected_token_ranks.tolist(),
                )
                entries = [(ids[j], values[j], ranks[j]) for j in range(end - start)]
            result.prompt_logprobs[req_id] = entries
