"""``python -m ember.bench.add_requests``: adding a request, microseconds, with a JSON schema and
without.

What `LLM.generate` does for each prompt before the first step (the front end's processing and
validation, the params cloned, the engine core's request and, for a constrained one, its grammar
handed to be built): `LLMEngine.add_request` timed over a batch of requests, each round the
constrained batch (the structured benchmark's six schemas, compact) then the plain one, on the
default model (the model is not run while timing; the requests are run out between rounds).
Each variant's best round counts. Also the wall time of the engine's first constrained request
(one request, one token), which starts the grammar machinery.
"""

from __future__ import annotations

import argparse
import sys
import time

from ember.bench.provenance import git_commit, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    ns = parser.parse_args(argv)

    from ember import LLM, SamplingParams, StructuredOutputsParams
    from ember.bench.structured import SCHEMAS

    llm = LLM(max_model_len=512)
    engine = llm.llm_engine
    prompts = [{"prompt_token_ids": [1, 2, 3, 4 + i]} for i in range(ns.requests)]
    variants = {
        "json_schema": [SamplingParams(temperature=0, max_tokens=1, structured_outputs=(
            StructuredOutputsParams(json=SCHEMAS[i % len(SCHEMAS)], disable_any_whitespace=True)))
            for i in range(ns.requests)],
        "plain": [SamplingParams(temperature=0, max_tokens=1) for _ in range(ns.requests)],
    }
    # The engine's first constrained request also starts the grammar machinery (the backend's
    # tokenizer tables, or the grammar process): its wall time, one request.
    start = time.perf_counter()
    llm.generate(prompts[:1], variants["json_schema"][:1], use_tqdm=False)
    first_request_s = time.perf_counter() - start
    llm.generate(prompts, variants["json_schema"], use_tqdm=False)  # grammars compiled
    best = {name: float("inf") for name in variants}
    for round_index in range(ns.rounds):
        for name, params in variants.items():
            start = time.perf_counter()
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                engine.add_request(f"{name}-{round_index}-{i}", prompt, sp)
            best[name] = min(best[name], (time.perf_counter() - start) / ns.requests * 1e6)
            while engine.has_unfinished_requests():
                engine.step()
    core = getattr(engine, "engine_core", None)  # None when the core runs in its own process
    grammar_process = None if core is None else core.structured_output.uses_process
    llm.shutdown()
    report({"commit": git_commit(), "requests": ns.requests, "us_per_request": best,
            "first_json_schema_request_s": first_request_s, "grammar_process": grammar_process},
           ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
