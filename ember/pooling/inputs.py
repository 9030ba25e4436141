"""Pooling prompts and params, checked once for every front end (LLM, AsyncLLM, the server).

`model_kind` says what a served pooling model gives ("embed" or "classify"), `verify_params`
checks PoolingParams against a task and the model (Matryoshka dimensions, fields the task cannot
honour), and `tokenize_prompts` turns text / token-id prompts (or sentence pairs) into token ids
in one batched tokenizer call, refusing empty prompts, prompts longer than max_model_len (unless
truncate_prompt_tokens is given) and ids outside the vocabulary, each with a ValueError.
"""

from __future__ import annotations

from typing import Any

from ember.pooling.params import PoolingParams


def is_classifier(model_config) -> bool:
    return model_config.architecture.endswith("ForSequenceClassification")


def model_kind(model_config) -> str:
    """"classify" for a classifier (cross-encoders included), "embed" otherwise."""
    return "classify" if is_classifier(model_config) else "embed"


def num_labels(model_config) -> int:
    return int(getattr(model_config.hf_config, "num_labels", 1) or 1)


def matryoshka(model_config) -> bool | list[int]:
    hf = model_config.hf_config
    dims = getattr(hf, "matryoshka_dimensions", None)
    return list(dims) if dims else bool(getattr(hf, "is_matryoshka", False))


def verify_params(params: PoolingParams, task: str, model_config,
                  truncate: int | None = None) -> PoolingParams:
    """A checked copy of `params` for `task` (with `truncate` as truncate_prompt_tokens)."""
    if not isinstance(params, PoolingParams):
        raise ValueError(f"pooling_params must be PoolingParams, got {type(params).__name__}")
    kind = model_kind(model_config)
    if (task == "embed" and kind == "classify") or (task in ("classify", "score")
                                                    and kind == "embed"):
        what = "a classifier" if kind == "classify" else "an embedding model"
        raise ValueError(f"task {task!r} does not apply to {model_config.architecture}, "
                         f"{what}")
    hidden = int(getattr(model_config.hf_config, "hidden_size", 0)) or None
    dims = matryoshka(model_config)
    checked = params.verify(task, hidden, dims, kind)
    if truncate is not None:
        if checked.truncate_prompt_tokens not in (None, truncate):
            raise ValueError("truncate_prompt_tokens given twice with different values")
        checked.truncate_prompt_tokens = truncate
        checked.verify(task, None, dims, kind)
    return checked


def check_prompt_ids(ids: list[int], index: int, max_len: int, vocab: int) -> None:
    if not ids:
        raise ValueError(f"prompt {index} is empty: give at least one token")
    if len(ids) > max_len:
        raise ValueError(f"prompt {index} has {len(ids)} tokens, more than max_model_len="
                         f"{max_len}: shorten it or pass truncate_prompt_tokens")
    bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"prompt {index}: token ids out of vocabulary [0, {vocab}): {bad[:5]}")


def _keep(keep: int, max_len: int) -> int:
    if keep == -1:
        return max_len
    if keep > max_len:
        raise ValueError(f"truncate_prompt_tokens={keep} is greater than max_model_len={max_len}")
    return keep


def tokenize_prompts(tok, prompts: list[Any], plist: list[PoolingParams], max_len: int,
                     vocab: int, pairs: list[tuple[str, str]] | None = None,
                     add_special_tokens: bool = True, check_keys=None) -> list[list[int]]:
    """Token ids per prompt; for `pairs`, each pair's second-segment start goes into its params
    (`plist` entries are replaced by copies). `check_keys(dict)` refuses unknown prompt keys."""
    ids: list[list[int] | None] = [None] * len(prompts)
    texts: dict[int | None, list[int]] = {}  # truncation -> indices of text prompts
    for i, prompt in enumerate(prompts):
        keep = plist[i].truncate_prompt_tokens
        if keep is not None:
            _keep(keep, max_len)
        if isinstance(prompt, dict):
            if check_keys is not None:
                check_keys(prompt)
            if "prompt_token_ids" in prompt:
                toks = list(prompt["prompt_token_ids"])
                ids[i] = toks[-_keep(keep, max_len):] if keep is not None else toks
                continue
            prompt = prompt.get("prompt")
        if not isinstance(prompt, str):
            raise ValueError("a prompt must be a string, a TextPrompt or a TokensPrompt, got "
                             f"{type(prompt).__name__}")
        if not prompt:
            raise ValueError(f"prompt {i} is empty: give at least one token")
        texts.setdefault(keep, []).append(i)
    if texts and tok is None:
        raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True was set)")
    for keep, idx in texts.items():
        kw: dict[str, Any] = {"add_special_tokens": add_special_tokens}
        if keep is not None:  # the tokenizer truncates, keeping its special tokens
            kw.update(truncation=True, max_length=_keep(keep, max_len))
        if pairs is None:
            enc = tok([_text(prompts[i]) for i in idx], **kw)
        else:
            enc = tok([pairs[i][0] for i in idx], [pairs[i][1] for i in idx], **kw)
        for j, i in enumerate(idx):
            ids[i] = list(enc["input_ids"][j])
            if pairs is not None:
                seq = enc.sequence_ids(j) if hasattr(enc, "sequence_ids") else None
                start = next((k for k, s in enumerate(seq or []) if s == 1), None)
                plist[i] = plist[i].clone()
                plist[i].pair_start = start
    for i, toks in enumerate(ids):
        assert toks is not None
        check_prompt_ids(toks, i, max_len, vocab)
    return ids  # type: ignore[return-value]


def _text(prompt: Any) -> str:
    return prompt if isinstance(prompt, str) else prompt["prompt"]
