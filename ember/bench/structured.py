"""``python -m ember.bench.structured``: what structured outputs cost, same run.

N chat requests, each constrained by one of a set of real-world JSON schemas (greedy), against
the same requests unconstrained, each generating exactly as many tokens as its constrained twin
(`ignore_eos`, `max_tokens` = that count), so both runs do the same work apart from the grammar.
After a warm-up of each (every grammar compiled), `--repeats` rounds each time the constrained
run then the unconstrained one; the ratio reported is the median of the rounds'. Also the
compile time of each schema on a cold backend (p50/p99).
--out writes the results as JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

from ember.bench.provenance import git_commit, report
from ember.gc_heap import freeze_process_heap

SCHEMAS: list[dict] = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130},
                                      "email": {"type": "string", "maxLength": 40}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {
        "street": {"type": "string", "maxLength": 30}, "city": {"type": "string", "maxLength": 20},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]}},
     "required": ["street", "city", "country"]},
    {"type": "object", "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "maxLength": 8},
                                             "qty": {"type": "integer", "minimum": 1,
                                                     "maximum": 9}},
            "required": ["sku", "qty"]}},
        "total": {"type": "number", "minimum": 0, "maximum": 10000}},
     "required": ["order_id", "items"]},
    {"type": "object", "properties": {
        "event": {"type": "string", "maxLength": 24},
        "level": {"type": "string", "enum": ["low", "medium", "high"]},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 10}},
        "resolved": {"type": "boolean"}},
     "required": ["event", "level", "resolved"]},
    {"$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": -100, "maximum": 100},
        "y": {"type": "integer", "minimum": -100, "maximum": 100}}, "required": ["x", "y"]}},
     "type": "object", "properties": {"start": {"$ref": "#/$defs/point"},
                                      "end": {"$ref": "#/$defs/point"},
                                      "label": {"anyOf": [{"type": "string", "maxLength": 12},
                                                          {"type": "null"}]}},
     "required": ["start", "end"]},
    {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30},
        "rating": {"type": "number", "minimum": 0, "maximum": 5},
        "genres": {"type": "array", "minItems": 1, "maxItems": 2,
                   "items": {"type": "string", "enum": ["drama", "comedy", "action", "sci-fi"]}}},
     "required": ["title", "rating", "genres"]},
]
THINGS = ["a person", "an address", "an order", "an incident", "a line segment", "a film"]


def _compile_times(llm, backend_name: str) -> dict:
    from ember.sampling_params import StructuredOutputsParams
    from ember.structured_output.config import StructuredOutputsConfig
    from ember.structured_output.interface import GrammarSpec
    from ember.structured_output.validation import resolve_backend_class, select_backend

    config = StructuredOutputsConfig(backend=backend_name)
    tokenizer = llm.get_tokenizer()
    vocab = llm.llm_engine.model_config.vocab_size
    times, names = [], set()
    for schema in SCHEMAS:
        spec = GrammarSpec.of(StructuredOutputsParams(json=schema), config)
        name = select_backend(spec, backend_name)
        names.add(name)
        backend = resolve_backend_class(name)(tokenizer, vocab, config)  # cold: a new compiler
        start = time.perf_counter()
        backend.compile(spec)
        times.append(time.perf_counter() - start)
    times.sort()
    return {"backends": sorted(names), "p50_ms": 1000 * statistics.median(times),
            "p99_ms": 1000 * times[min(len(times) - 1, int(0.99 * len(times)))],
            "max_ms": 1000 * times[-1], "schemas": len(times)}


def run(ns: argparse.Namespace) -> dict:
    from ember import LLM, SamplingParams
    from ember.sampling_params import StructuredOutputsParams

    llm = LLM(ns.model, max_model_len=ns.max_model_len, load_format=ns.load_format,
              structured_outputs_config={"backend": ns.backend},
              async_scheduling=ns.async_scheduling or None)  # None: the platform's default
    tokenizer = llm.get_tokenizer()
    prompts = []
    for i in range(ns.num_prompts):
        messages = [{"role": "user", "content": f"Give {THINGS[i % len(THINGS)]} as JSON "
                                                f"(example {i})."}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # a BatchEncoding
            ids = ids["input_ids"]
        prompts.append({"prompt_token_ids": list(ids)})
    constrained = [SamplingParams(temperature=0, max_tokens=ns.max_tokens,
                                  structured_outputs=StructuredOutputsParams(
                                      json=SCHEMAS[i % len(SCHEMAS)],
                                      # Random weights would fill JSON's optional whitespace.
                                      disable_any_whitespace=ns.compact))
                   for i in range(ns.num_prompts)]
    compile_stats = _compile_times(llm, ns.backend)
    # Warm-ups: every grammar compiled; the constrained outputs fix each request's length.
    outs = llm.generate(prompts, constrained, use_tqdm=False)
    counts = [len(o.outputs[0].token_ids) for o in outs]
    plain = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in counts]
    llm.generate(prompts, plain, use_tqdm=False)
    # As an application that builds its engine once may: what start-up and the warm-ups made
    # out of the collector's full walks (ember.gc_heap; EMBER_GC_FREEZE=0 leaves them in).
    freeze_process_heap("benchmark")

    function_times = None
    if ns.function_times:
        from ember.bench.function_times import ENGINE_STEP_FUNCTIONS, FunctionTimes

        function_times = FunctionTimes(ENGINE_STEP_FUNCTIONS).__enter__()

    def timed(params: list) -> tuple[float, dict | None, list]:
        timer = _reset_timer(llm)
        if function_times is not None:
            function_times.label = ("unconstrained" if params[0].structured_outputs is None
                                    else "constrained")
        with _CollectorPauses() as pauses:
            start = time.perf_counter()
            run_outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
        if function_times is not None:
            function_times.label = None
        assert [len(o.outputs[0].token_ids) for o in run_outs] == counts
        return seconds, _timing(timer, seconds, pauses), run_outs

    # The two variants alternate, so a machine whose speed drifts between them (the H200 host's
    # unconstrained runs have differed 1.7x from one invocation to the next) shows in the spread
    # of the rounds' ratios rather than in one ratio.
    rounds = []
    manager = _structured_manager(llm) if ns.ab_deferred_accepts else None
    for _ in range(ns.repeats):
        constrained_s, constrained_timing, outs = timed(constrained)
        plain_s, plain_timing, _ = timed(plain)
        rounds.append({"constrained_s": round(constrained_s, 4), "unconstrained_s":
                       round(plain_s, 4), "ratio": round(plain_s / constrained_s, 4)})
        if constrained_timing is not None:  # what made a slow round slow
            rounds[-1]["totals_ms"] = {"constrained": constrained_timing.pop("totals_ms"),
                                       "unconstrained": plain_timing.pop("totals_ms")}
        if manager is not None:  # the grammars advanced on the helper thread, batched
            manager.defer_accepts = True
            try:
                deferred_s, deferred_timing, _ = timed(constrained)
            finally:
                manager.defer_accepts = False
            rounds[-1]["constrained_deferred_accepts_s"] = round(deferred_s, 4)
    valid = sum(is_json(o.outputs[0].text) for o in outs)
    tokens = sum(counts)
    ratios = [r["ratio"] for r in rounds]
    result = {
        "commit": git_commit(), "model": ns.model or "SmolLM2-135M-Instruct (default)",
        "platform": llm.platform, "backend_setting": ns.backend, "requests": ns.num_prompts,
        "output_tokens": tokens, "outputs_valid_json": valid,
        "constrained_tok_s": tokens / statistics.median(r["constrained_s"] for r in rounds),
        "unconstrained_tok_s": tokens / statistics.median(r["unconstrained_s"] for r in rounds),
        "constrained_over_unconstrained": statistics.median(ratios),
        "ratio_min_max": [min(ratios), max(ratios)], "rounds": rounds,
        "compile": compile_stats,
        "grammar_process": getattr(getattr(getattr(llm.llm_engine, "engine_core", None),
                                           "structured_output", None), "uses_process", None),
        "engine_core": ("own process" if llm.llm_engine.client.multiprocess
                        else "in process"),  # EMBER_ENGINE_PROCESS=1: the server's layout
        "load_average": list(os.getloadavg()),  # a shared machine: how busy it was
    }
    if manager is not None:
        result["constrained_deferred_accepts_tok_s"] = tokens / statistics.median(
            r["constrained_deferred_accepts_s"] for r in rounds)
    if function_times is not None:  # host time per call of the engine thread's functions
        function_times.__exit__()
        result["function_times"] = function_times.summary()
    if constrained_timing is not None:  # EMBER_STEP_TIMING=1: ms per step, the last round
        result["step_ms"] = {"constrained": constrained_timing, "unconstrained": plain_timing}
        if manager is not None:
            result["step_ms"]["constrained_deferred_accepts"] = deferred_timing
    llm.shutdown()
    return result


def _structured_manager(llm):
    """The engine core's StructuredOutputManager, whose accepts can be deferred (async
    scheduling with deferred sampling) for the A/B."""
    core = llm.llm_engine.engine_core
    if not core.defers_grammar_sampling:
        raise SystemExit("--ab-deferred-accepts needs async scheduling (--async-scheduling)")
    return core.structured_output


def _reset_timer(llm):
    """The engine core's step timer, cleared (None when the core runs in another process)."""
    engine = llm.llm_engine
    if engine.client.multiprocess:
        return None
    timer = engine.engine_core.timer
    timer.seconds.clear()
    timer.steps = 0
    return timer


class _CollectorPauses:
    """The garbage collector's pauses in this process while inside: how many full
    (generation 2) collections ran, and the milliseconds all collections took."""

    def __enter__(self) -> _CollectorPauses:
        self.full = 0
        self.ms = 0.0
        self._start = 0.0
        gc.callbacks.append(self._record)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._record)

    def _record(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.ms += 1000 * (time.perf_counter() - self._start)
            self.full += info["generation"] == 2


def _timing(timer, seconds: float, pauses: _CollectorPauses) -> dict | None:
    if timer is None or not timer.enabled:
        return None
    phases = timer.summary()
    # The round's time the steps do not hold: adding its requests (front end and engine core),
    # and what follows the last step (a round's fixed costs, spread over its steps).
    steps = max(timer.steps, 1)
    outside = 1000 * seconds / steps - sum(v for k, v in phases.items()
                                           if not k.startswith(("helper", "process")))
    # The round's totals, to compare rounds: steps, collector pauses, each phase.
    totals = {"steps": timer.steps, "gc_full": pauses.full, "gc_ms": round(pauses.ms, 1),
              **{k: round(1000 * v, 1) for k, v in timer.seconds.items()},
              "outside the steps": round(outside * steps, 1)}
    return {"num_steps": timer.steps, **{k: round(v, 3) for k, v in phases.items()},
            "outside the steps": round(outside, 3), "totals_ms": totals}


def is_json(text: str) -> bool:
    """Whether the text parses as one JSON value."""
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--load-format", default="auto",
                        help="dummy: random weights (a config dir with a tokenizer)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--backend", default="auto", help="auto, xgrammar, guidance, ...")
    parser.add_argument("--compact", action="store_true",
                        help="disable_any_whitespace (needed with dummy weights)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed rounds, each constrained then unconstrained (median ratio)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="force async scheduling (on where the platform defaults it; on a "
                             "CPU it runs the deferred grammar sampling of the GPU path)")
    parser.add_argument("--ab-deferred-accepts", action="store_true",
                        help="each round also runs the constrained requests with deferred "
                             "accepts (EMBER_GRAMMAR_DEFERRED_ACCEPTS: the grammars advanced "
                             "on the bitmask helper thread, one batched call)")
    parser.add_argument("--function-times", action="store_true",
                        help="also report the host time per call of the engine thread's "
                             "functions (ember.bench.function_times), each kind of round apart")
    parser.add_argument("--out", default=None)
    ns = parser.parse_args(argv)
    result = run(ns)
    report(result, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
