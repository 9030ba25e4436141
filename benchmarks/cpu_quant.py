"""Quantized CPU inference, side by side in one run: ember kept quantized (the gguf method),
ember float (quantization="none": the GGUF dequantized at load), HF transformers (float32, the
same GGUF) and llama.cpp (llama-cpp-python, the same GGUF, its own venv).

Workloads on the default model (SmolLM2-135M-Instruct Q4_1): a single stream (one chat prompt,
128 greedy tokens, EOS ignored) and a batch (32 requests x 128 random prompt tokens, 64 greedy
output tokens). Each engine runs in its own subprocess, one after another; load time is the
model's construction to ready. llama-cpp-python serves one sequence at a time, so its batch
figure is the 32 requests run back to back.

Variant ``kernel`` (and ``kernel-base``) times ember's quantized CPU kernel alone instead: one
``quant_linear`` call at each of the default model's layer shapes and 1, 4, 32 and 128 rows
(microseconds, the median of repeated calls). Variant ``attention`` times the CPU decode
attention alone at the batch's decode shape: 32 requests of 160 keys in the default model's
heads (9 query / 3 kv heads of 64), 16-token blocks scattered over 30 layers' caches of their
own (so the keys come from memory, as in a step), a call a layer.

    python benchmarks/cpu_quant.py [--llamacpp-python /tmp/llamacpp-venv/bin/python]
        [--threads 2] [--only ember-quant,ember-float,hf,llamacpp] [--json out.json]
        [--baseline-src /tmp/base --only ember-quant-base,ember-quant,...]
    python benchmarks/cpu_quant.py --threads 1 --baseline-src /tmp/base \
        --only kernel-base,kernel,kernel-base,kernel   (or attention-base,attention,...)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

CHAT = "Write a short story about a dragon who learns to paint."
SINGLE_TOKENS, BATCH, PROMPT_LEN, BATCH_OUT = 128, 32, 128, 64
VARIANTS = ("ember-quant", "ember-float", "hf", "llamacpp")
# The default model's quantized layers: (name, N, K, bits).
KERNEL_SHAPES = (("gate_up", 3072, 576, 4), ("down", 576, 1536, 4), ("qkv", 960, 576, 4),
                 ("head", 49152, 576, 8))
KERNEL_ROWS = (1, 4, 32, 128)


def _model_path() -> str:
    from ember.default_model import default_model_path

    return default_model_path()


def _prompts(vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(0)
    return [[rng.randrange(100, vocab - 100) for _ in range(PROMPT_LEN)] for _ in range(BATCH)]


def _chat_ids(path: str) -> list[int]:
    from ember.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    return list(tok.apply_chat_template([{"role": "user", "content": CHAT}],
                                        add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


def run_ember(quantization: str | None) -> dict:
    from ember import LLM, SamplingParams

    t0 = time.perf_counter()
    # Load = the engine ready to serve, its tokenizer included (llama.cpp's Llama() reads its
    # tokenizer from the GGUF too); imports are not counted.
    llm = LLM(quantization=quantization, max_num_seqs=BATCH)
    load = time.perf_counter() - t0
    chat = list(llm.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": CHAT}], add_generation_prompt=True, tokenize=True,
        return_dict=False))
    single = SamplingParams(temperature=0, max_tokens=SINGLE_TOKENS, ignore_eos=True)
    llm.generate({"prompt_token_ids": chat}, single, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    out = llm.generate({"prompt_token_ids": chat}, single, use_tqdm=False)
    single_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": p} for p in _prompts(llm.llm_engine.model_config.vocab_size)]
    batch = SamplingParams(temperature=0, max_tokens=BATCH_OUT, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, batch, use_tqdm=False)
    batch_s = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"load_s": load, "single_tok_s": len(out[0].outputs[0].token_ids) / single_s,
            "batch_tok_s": produced / batch_s, "first_tokens": out[0].outputs[0].token_ids[:16]}


def run_hf() -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    path = _model_path()
    chat = _chat_ids(path)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                 gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    load = time.perf_counter() - t0
    kw = dict(do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        ids = torch.tensor([chat])
        model.generate(ids, max_new_tokens=8, min_new_tokens=8, **kw)
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=SINGLE_TOKENS, min_new_tokens=SINGLE_TOKENS, **kw)
        single_s = time.perf_counter() - t0
        batch = torch.tensor(_prompts(model.config.vocab_size))
        t0 = time.perf_counter()
        outs = model.generate(batch, attention_mask=torch.ones_like(batch),
                              max_new_tokens=BATCH_OUT, min_new_tokens=BATCH_OUT, **kw)
        batch_s = time.perf_counter() - t0
    produced = (outs.shape[1] - PROMPT_LEN) * BATCH
    return {"load_s": load, "single_tok_s": (out.shape[1] - len(chat)) / single_s,
            "batch_tok_s": produced / batch_s, "first_tokens": out[0, len(chat):][:16].tolist()}


def run_llamacpp(path: str, chat: list[int], vocab: int, threads: int) -> dict:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=path, n_threads=threads, n_ctx=512, n_batch=512, verbose=False)
    load = time.perf_counter() - t0

    def greedy(prompt: list[int], n: int) -> list[int]:
        llm.reset()
        out = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(tok)
            if len(out) == n:
                break
        return out

    greedy(chat, 8)
    t0 = time.perf_counter()
    out = greedy(chat, SINGLE_TOKENS)
    single_s = time.perf_counter() - t0
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(PROMPT_LEN)] for _ in range(BATCH)]
    t0 = time.perf_counter()
    produced = sum(len(greedy(p, BATCH_OUT)) for p in prompts)
    batch_s = time.perf_counter() - t0
    return {"load_s": load, "single_tok_s": len(out) / single_s,
            "batch_tok_s": produced / batch_s, "first_tokens": out[:16]}


def run_kernel() -> dict:
    import statistics

    import torch

    from ember.kernels.cpu import quant_linear as kernel

    generator = torch.Generator().manual_seed(0)
    result: dict[str, dict[int, float]] = {}
    for name, n, k, bits in KERNEL_SHAPES:
        low, high = (0, 16) if bits == 4 else (-128, 128)
        codes = torch.randint(low, high, (n, k), generator=generator)
        scale = torch.rand(n, k // 32, generator=generator) * 0.01
        blocks = kernel.pack(codes, scale, -scale * 4, bits=bits)
        result[name] = {}
        for rows in KERNEL_ROWS:
            x = torch.randn(rows, k, generator=generator)
            kernel.quant_linear(x, blocks, n, bits)  # warm-up
            calls = max(5, int(2e8 / (rows * n * k)))
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                kernel.quant_linear(x, blocks, n, bits)
                times.append(time.perf_counter() - t0)
            result[name][rows] = statistics.median(times) * 1e6
    return {"kernel_us": result}


def run_attention() -> dict:
    import statistics

    import torch

    from ember.kernels.cpu import layer_ops

    generator = torch.Generator().manual_seed(0)
    reqs, q_heads, kv_heads, head, block, keys, layers = 32, 9, 3, 64, 16, 160, 30
    num_blocks = 3000
    caches = [torch.randn(2, num_blocks, block, kv_heads, head, generator=generator)
              for _ in range(layers)]
    per_req = -(-keys // block)
    table = torch.randperm(num_blocks, generator=generator)[: reqs * per_req]
    table = table.to(torch.int32).view(reqs, per_req)
    seq_lens = torch.full((reqs,), keys, dtype=torch.int32)
    q = torch.randn(reqs, q_heads, head, generator=generator)
    out = torch.empty(reqs, q_heads * head)
    times = []
    for _ in range(12):
        t0 = time.perf_counter()
        for cache in caches:
            layer_ops.decode_attention(q, cache, table, seq_lens, out, head**-0.5, None, None)
        times.append((time.perf_counter() - t0) / layers)
    kv_bytes = 2 * reqs * keys * kv_heads * head * 4
    call = statistics.median(times[2:])
    return {"attention_us": call * 1e6, "attention_gb_s": kv_bytes / call / 1e9}


def _child(variant: str, args: argparse.Namespace) -> dict:
    """Run one variant in a fresh interpreter and return its JSON line."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), EMBER_DISABLE_PROGRESS="1")
    if variant == "llamacpp":
        path = _model_path()
        from ember.tokenizer import load_tokenizer

        vocab = len(load_tokenizer(path))
        code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); "
                f"import cpu_quant as b; print(json.dumps(b.run_llamacpp({path!r}, "
                f"{_chat_ids(path)!r}, {vocab}, {args.threads})))")
        cmd = [args.llamacpp_python, "-c", code]
    elif variant.endswith("-base"):  # the same engine from another source tree (a baseline)
        env["PYTHONPATH"] = args.baseline_src
        cmd = [sys.executable, __file__, "--child", variant[: -len("-base")], "--threads",
               str(args.threads)]
    else:
        cmd = [sys.executable, __file__, "--child", variant, "--threads", str(args.threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llamacpp-python", default="/tmp/llamacpp-venv/bin/python")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default=",".join(VARIANTS))
    parser.add_argument("--json", default=None)
    parser.add_argument("--baseline-src", default=None,
                        help="a checkout of another commit: variants NAME-base (ember-quant-base) "
                             "run ember from it, e.g. `git worktree add /tmp/base <commit>`")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        import torch

        torch.set_num_threads(args.threads)
        if args.child == "kernel":
            result = run_kernel()
        elif args.child == "attention":
            result = run_attention()
        else:
            result = run_hf() if args.child == "hf" else run_ember(
                None if args.child == "ember-quant" else "none")
        print(json.dumps(result))
        return
    rows = {}
    for variant in args.only.split(","):
        key, again = variant, 2
        while key in rows:  # a variant named twice (alternating runs) is kept each time
            key, again = f"{variant}#{again}", again + 1
        rows[key] = _child(variant, args)
        print(key, json.dumps(rows[key]), flush=True)
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    print(f"\n{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  commit {commit}  {cpu}  "
          f"threads {args.threads}  load average {os.getloadavg()[0]:.1f}")
    print(f"{'engine':<12} {'load s':>8} {'single tok/s':>13} {'batch tok/s':>12}")
    for variant, r in rows.items():
        if "kernel_us" in r:
            print(f"{variant:<12} us a call at {'/'.join(map(str, KERNEL_ROWS))} rows: " + "  ".join(
                f"{name} {'/'.join(f'{us:.0f}' for us in by_rows.values())}"
                for name, by_rows in r["kernel_us"].items()))
        elif "attention_us" in r:
            print(f"{variant:<12} decode attention {r['attention_us']:.0f} us a layer "
                  f"({r['attention_gb_s']:.1f} GB/s of keys and values)")
        elif "error" in r:
            print(f"{variant:<12} error: {r['error']}")
        else:
            print(f"{variant:<12} {r['load_s']:>8.2f} {r['single_tok_s']:>13.1f} "
                  f"{r['batch_tok_s']:>12.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"commit": commit, "cpu": cpu, "threads": args.threads, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
