"""``python -m ember.bench.grammar_host``: the host-side cost of structured outputs per step.

Drives ember's StructuredOutputManager as the engine core does, without a model: N requests,
each with one of ember.bench.structured's JSON schemas (`disable_any_whitespace`, as that
benchmark), grammars built on the manager's pool; then per step `fill(rows)` (the bitmask, as
EngineCore._finish_sampling) and, per sampled token, `append_output_token`, then the step's
tokens in one `accept_many` (as Scheduler.update_from_output). Each row's token is drawn
uniformly from what its mask allows (a model with dummy weights samples about so), from one
seeded generator, so every variant sees the same tokens; the draw is not timed.

Variants, side by side in one run, per backend:
- `model-width`: the grammar tables and bitmask span the model's vocabulary (`--vocab-size`,
  Qwen3's 151,936 by default) as the manager did before it used the tokenizer's own size;
- `tokenizer-width`: the manager as it is, the step's tokens accepted as they are folded in;
- `deferred`: the same with deferred accepts (async scheduling): accept() only records the
  token, and the fill first advances every grammar in one batched backend call (the fill's
  time then holds the accepts);
- `process`: the grammars in the grammar process (as on a GPU host): the engine thread's own
  time, apart from the process's work that overlaps the forward: sending the step's message
  (`fill_async`), then, after `--forward-ms` standing for the forward, taking the answer, and
  recording the step's tokens (`accept_many`). Both sides poll for `--spin-ms` before they
  block.
The tokenizer is the default model's (49,152 tokens: a word tokenizer cannot spell JSON), as in
the H200 structured benchmark, whose model is Qwen3-0.6B.
"""

from __future__ import annotations

import argparse
import sys
import time

from tqdm import tqdm

from ember.bench.provenance import git_commit, report
from ember.bench.structured import SCHEMAS, is_json


def _manager(backend: str, tokenizer, vocab_size: int, model_width: bool):
    from ember.structured_output.config import StructuredOutputsConfig
    from ember.structured_output.manager import StructuredOutputManager

    class ModelWidthManager(StructuredOutputManager):
        """The bitmask and grammar tables as wide as the model's logits (the earlier manager)."""

        def _grammar_vocab_size(self, tok) -> int:
            return max(vocab_size, len(tok))

    cls = ModelWidthManager if model_width else StructuredOutputManager
    return cls(StructuredOutputsConfig(backend=backend), lambda: tokenizer, vocab_size)


def _requests(ns: argparse.Namespace, eos: int):
    from ember.core.request import Request
    from ember.sampling_params import SamplingParams, StructuredOutputsParams

    return [Request(str(i), [1, 2, 3], SamplingParams(
        temperature=0, max_tokens=ns.max_tokens, structured_outputs=StructuredOutputsParams(
            json=SCHEMAS[i % len(SCHEMAS)], disable_any_whitespace=True)), {eos}, 16)
            for i in range(ns.num_requests)]


def run_variant(ns: argparse.Namespace, tokenizer, backend: str, model_width: bool,
                deferred: bool = False, process: bool = False) -> dict:
    import functools

    import numpy as np

    from ember.default_model import default_model_path
    from ember.tokenizer import load_tokenizer

    manager = _manager(backend, tokenizer, ns.vocab_size, model_width)
    manager.defer_accepts = deferred
    if process:  # the process loads the tokenizer itself
        manager._load_tokenizer = functools.partial(load_tokenizer,
                                                    ns.tokenizer or default_model_path())
        manager.use_process(3, None, ns.spin_ms / 1e3)
    requests = _requests(ns, tokenizer.eos_token_id)
    start = time.perf_counter()
    for request in requests:
        manager.add(request)
    while not all(manager.ready(r) for r in requests):
        manager.wait(0.01)
    build_s = time.perf_counter() - start
    assert all(r.structured_output.error is None for r in requests)
    rng = np.random.default_rng(ns.seed)
    ntok = len(tokenizer)
    live, fill_s, accept_s, steps, tokens = list(requests), 0.0, 0.0, 0, 0
    send_s = answer_s = 0.0
    bar = tqdm(total=len(requests), desc=f"{backend} {'model' if model_width else 'tokenizer'}"
               "-width", leave=False)
    while live:
        t0 = time.perf_counter()
        if process:  # the engine thread's part only: the process works during the "forward"
            pending = manager.fill_async(live)
            sent = time.perf_counter()
            time.sleep(ns.forward_ms / 1e3)
            asked = time.perf_counter()
            grammar = pending.result()
            send_s += sent - t0
            answer_s += time.perf_counter() - asked
        else:
            grammar = manager.fill(live)
            fill_s += time.perf_counter() - t0
        ended = {r.request_id for r, _ in manager.take_finished()}  # deferred: complete
        if ended:
            bar.update(len(ended))
            live = [r for r in live if r.request_id not in ended]
        rows = {rid: i for i, rid in enumerate(grammar.req_ids)}
        words = grammar.bitmask.numpy()
        picks = []
        for request in live:  # not timed: stands for the forward and the sampler
            bits = np.unpackbits(words[rows[request.request_id]].view(np.uint8),
                                 bitorder="little")[:ntok]
            allowed = np.flatnonzero(bits)
            picks.append(int(allowed[rng.integers(len(allowed))]))
        t2 = time.perf_counter()
        for request, token in zip(live, picks):
            request.append_output_token(token)
        finished = {id(r) for r in manager.accept_many(list(zip(live, picks)))}
        still = [r for r in live
                 if id(r) not in finished and len(r.output_token_ids) < ns.max_tokens]
        t3 = time.perf_counter()
        accept_s += t3 - t2
        steps += 1
        tokens += len(live)
        bar.update(len(live) - len(still))
        live = still
    bar.close()
    manager.shutdown()
    fill_s += send_s + answer_s  # the process variant's: the engine thread's own time
    texts = [tokenizer.decode(r.output_token_ids, skip_special_tokens=True) for r in requests]
    valid = sum(is_json(t) for t in texts)
    result = {
            "backend": backend, "width": "model" if model_width else "tokenizer",
            "accepts": ("sent to the grammar process" if process else
                        "deferred to the fill" if deferred else "a call a step"),
            "bitmask_words": (manager.vocab_size + 31) // 32, "grammars_built_s": build_s,
            "steps": steps, "tokens": tokens, "outputs_valid_json": valid,
            "accept_us_per_token": 1e6 * accept_s / tokens,
            "accept_ms_per_step": 1e3 * accept_s / steps, "fill_ms_per_step": 1e3 * fill_s / steps,
            "host_ms_per_step": 1e3 * (accept_s + fill_s) / steps}
    if process:
        result.update(send_ms_per_step=1e3 * send_s / steps,
                      answer_ms_per_step=1e3 * answer_s / steps, forward_ms=ns.forward_ms)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=151936,
                        help="the model's logits width (default: Qwen3's)")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "guidance"])
    parser.add_argument("--variants", nargs="+", default=["model", "tokenizer"],
                        choices=["model", "tokenizer", "deferred", "process"],
                        help="deferred: tokenizer width, the grammars advanced by the fill (one "
                             "batched call, as under async scheduling); process: the grammars "
                             "in the grammar process")
    parser.add_argument("--forward-ms", type=float, default=3.0,
                        help="process: the time the engine thread gives the process per step")
    parser.add_argument("--spin-ms", type=float, default=5.0)
    parser.add_argument("--tokenizer", default=None,
                        help="a tokenizer directory (default: the default model's tokenizer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    ns = parser.parse_args(argv)
    import os

    from ember.default_model import default_model_path
    from ember.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ns.tokenizer or default_model_path())
    results = [run_variant(ns, tokenizer, backend, variant == "model", variant == "deferred",
                           variant == "process")
               for backend in ns.backends for variant in ns.variants]
    out = {"commit": git_commit(), "tokenizer": ns.tokenizer or "default model's",
           "requests": ns.num_requests, "model_vocab": ns.vocab_size,
           "tokenizer_vocab": len(tokenizer), "cpus": os.cpu_count(),
           "load_average": os.getloadavg(), "runs": results}
    report(out, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
