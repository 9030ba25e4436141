"""``python -m ember.bench.detokenize``: the front end's detokenizer, microseconds a token.

Feeds token ids to ember.detokenizer.IncrementalDetokenizer as the output processor does, every
sequence one token a step, with each of its two decoders side by side in one run: ``stream``
(tokenizers' DecodeStream, what fast tokenizers take) and ``window`` (the window of two
``tokenizer.decode`` calls, what the others take); and ``stream_at_end``, each sequence's tokens
in one call once it ends (a FINAL_ONLY request without stop strings, `LLM.generate`'s). The
text is this repository's documentation, encoded with the default model's tokenizer (byte-level
BPE, 49,152 tokens) unless ``--model`` names another; each sequence gets a five-token prompt as
decoding context, as a request does. The variants' texts must be equal, and equal to a full
decode but for leading whitespace (the context's). Rounds alternate the variants; each
variant's best round counts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ember.bench.provenance import git_commit, report


def _corpus() -> str:
    root = Path(__file__).resolve().parents[2]
    texts = [p.read_text(encoding="utf-8") for p in sorted((root / "docs").glob("*.md"))]
    return "\n".join(texts) or "The capital of France is Paris. " * 2000


def _run(tokenizer, sequences: list[list[int]], use_stream: bool,
         at_end: bool = False) -> tuple[float, list[str]]:
    """Microseconds a token and the texts: every sequence one token a step, as the output
    processor feeds a streamed request, or (``at_end``) each sequence's tokens in one call
    once it ends, as it feeds a FINAL_ONLY request without stop strings."""
    from ember import detokenizer

    saved = detokenizer._decode_stream
    if not use_stream:
        detokenizer._decode_stream = lambda *args: None
    try:
        start = time.perf_counter()
        detoks = [detokenizer.IncrementalDetokenizer(tokenizer, ids[:5]) for ids in sequences]
        if at_end:
            for detok, ids in zip(detoks, sequences):
                detok.append(ids[5:])
        else:
            for step in range(5, len(sequences[0])):
                for detok, ids in zip(detoks, sequences):
                    detok.append((ids[step],))
        for detok in detoks:
            detok.finish()
        tokens = sum(len(ids) - 5 for ids in sequences)
        return (time.perf_counter() - start) / tokens * 1e6, [d.text for d in detoks]
    finally:
        detokenizer._decode_stream = saved


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128, help="generated tokens a sequence")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    ns = parser.parse_args(argv)

    from ember.default_model import default_model_path
    from ember.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(ns.model or default_model_path())
    ids = tokenizer.encode(_corpus(), add_special_tokens=False)
    span = ns.tokens + 5
    sequences = [ids[(i * span) % max(1, len(ids) - span):][:span] for i in range(ns.sequences)]
    expected = [tokenizer.decode(s[5:], skip_special_tokens=True) for s in sequences]
    best = {"stream": float("inf"), "stream_at_end": float("inf"), "window": float("inf")}
    outputs: dict[str, list[str]] = {}
    for _ in range(ns.rounds):
        for name in best:
            us, outputs[name] = _run(tokenizer, sequences, name != "window",
                                     at_end=name == "stream_at_end")
            # The prompt context may change the first token's leading space only.
            if any(t.strip() != e.strip() for t, e in zip(outputs[name], expected, strict=True)):
                raise AssertionError(f"{name}: text differs from a full decode")
            best[name] = min(best[name], us)
    if not outputs["stream"] == outputs["stream_at_end"] == outputs["window"]:
        raise AssertionError("the decoders' texts differ")
    result = {"commit": git_commit(), "model": ns.model or "default (SmolLM2-135M GGUF)",
              "sequences": ns.sequences, "tokens_each": ns.tokens, "us_per_token": best,
              "window_over_stream": best["window"] / best["stream"],
              "stream_over_stream_at_end": best["stream"] / best["stream_at_end"]}
    report(result, ns.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
