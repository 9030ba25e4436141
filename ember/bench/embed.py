"""Embeddings per second of a pooling model, and the fraction of the device's matmul limit.

Made for the H200 with the BERT-large shape (ember/configs/bert-large: 24 layers, hidden 1024, 16
heads, intermediate 4096) and dummy weights, read through a word-level tokenizer written next to
the config (ember.bench.word_tokenizer), so words are tokens. Workloads (seeded): N sentences of
8-64 words, end to end through `LLM.embed` (tokenizing included) and as token ids (the engine
alone), and a larger batch of token-id prompts; each after a warm-up, best of `--repeats`.
Variants of the engine's batching (`--variants`, token budget / max_num_seqs / padded tokens per
forward) run in the same process one after another.

FLOPs counted per run: 2 x (matmul parameters of the encoder layers) x tokens, plus attention
(QK^T and PV: 4 x len^2 x hidden per layer per sentence, real lengths only); the fraction is
achieved FLOP/s over `--peak-tflops` (H200 bf16 dense: 989). Prints one JSON line; `--out`
writes it to a file too.

    python -m ember.bench.embed --model ember/configs/bert-large --out $OUT/embed.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from typing import Any


def sentence_ids(n: int, vocab: int, seed: int, lo: int = 8, hi: int = 64) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def encoder_flops(hf: Any, lengths: list[int]) -> float:
    """Matmul FLOPs of one pass over sentences of these lengths (embedding lookups and norms
    excluded: they are not matmuls)."""
    h, inter, layers = hf.hidden_size, hf.intermediate_size, hf.num_hidden_layers
    params = layers * (4 * h * h + 2 * h * inter)  # qkv + out projection + the two FFN matrices
    tokens = sum(lengths)
    attention = layers * 4 * h * sum(n * n for n in lengths)
    return 2.0 * params * tokens + attention


def best_time(fn, repeats: int) -> float:
    fn()  # warm-up: kernels picked, allocator grown
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_variant(model_dir: str, args: argparse.Namespace, variant: dict[str, int],
                small: list[list[int]], large: list[list[int]]) -> dict[str, Any]:
    import ember.pooling.runner as runner_mod
    from ember import LLM
    from ember.bench.word_tokenizer import word_of

    runner_mod.CHUNK_TOKENS = variant["chunk_tokens"]
    runner_mod.CHUNK_SEQS = variant["chunk_seqs"]
    llm = LLM(model=model_dir, load_format="dummy", dtype=args.dtype,
              max_num_batched_tokens=variant["max_num_batched_tokens"],
              max_num_seqs=variant["max_num_seqs"], hf_overrides=args.hf_overrides or {},
              max_model_len=args.max_model_len)
    try:
        hf = llm.llm_engine.model_config.hf_config
        texts = [" ".join(word_of(t) for t in ids) for ids in small]
        small_prompts = [{"prompt_token_ids": ids} for ids in small]
        large_prompts = [{"prompt_token_ids": ids} for ids in large]
        check = llm.embed(texts[:4], use_tqdm=False)
        assert all(len(o.outputs.embedding) == hf.hidden_size for o in check)
        assert [len(o.prompt_token_ids) for o in check] == [len(s) for s in small[:4]]
        out: dict[str, Any] = {"variant": variant}
        for name, prompts, lengths in (("text", texts, small), ("ids", small_prompts, small),
                                       ("large_ids", large_prompts, large)):
            def work(p=prompts) -> None:
                llm.embed(p, use_tqdm=False)
                sync()

            seconds = best_time(work, args.repeats)
            flops = encoder_flops(hf, [len(x) for x in lengths])
            out[name] = {
                "sentences": len(prompts), "tokens": sum(len(x) for x in lengths),
                "seconds": round(seconds, 4),
                "embeddings_per_s": round(len(prompts) / seconds, 1),
                "tokens_per_s": round(sum(len(x) for x in lengths) / seconds),
                "tflops": round(flops / seconds / 1e12, 3),
                "fraction_of_peak": round(flops / seconds / (args.peak_tflops * 1e12), 4),
            }
        return out
    finally:
        llm.shutdown()


def parse_variant(text: str) -> dict[str, int]:
    """'budget:seqs:chunk_tokens:chunk_seqs', e.g. 16384:256:4096:128 (the defaults)."""
    parts = [int(p) for p in text.split(":")]
    if len(parts) != 4:
        raise argparse.ArgumentTypeError("a variant is budget:seqs:chunk_tokens:chunk_seqs")
    keys = ("max_num_batched_tokens", "max_num_seqs", "chunk_tokens", "chunk_seqs")
    return dict(zip(keys, parts))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="ember/configs/bert-large")
    ap.add_argument("--n", type=int, default=1000, help="sentences of the text / ids runs")
    ap.add_argument("--large-n", type=int, default=16000, help="sentences of the large run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--hf-overrides", type=json.loads, default=None,
                    help='JSON, e.g. {"num_hidden_layers": 2} for a quick CPU check')
    ap.add_argument("--variants", type=parse_variant, nargs="+",
                    default=[parse_variant("16384:256:4096:128"),
                             parse_variant("65536:1024:16384:512")])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch

    from ember.bench.provenance import git_commit
    from ember.bench.word_tokenizer import has_tokenizer, write_word_tokenizer_model

    model_dir = args.model
    if not has_tokenizer(model_dir):
        model_dir = write_word_tokenizer_model(model_dir, tempfile.mkdtemp(prefix="ember-embed-"))
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    small = sentence_ids(args.n, vocab, seed=0)
    large = sentence_ids(args.large_n, vocab, seed=1)
    results = [run_variant(model_dir, args, v, small, large) for v in args.variants]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    best = max(r["large_ids"]["fraction_of_peak"] for r in results)
    summary = {"bench": "embed", "model": args.model, "dtype": args.dtype, "device": device,
               "commit": git_commit(), "peak_tflops": args.peak_tflops,
               "best_fraction_of_peak": best, "runs": results}
    line = json.dumps(summary)
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
