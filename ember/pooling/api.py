"""LLM.embed / classify / score / encode: the front end of pooling requests.

Prompts are tokenized in one batched tokenizer call, checked (empty, too long unless
`truncate_prompt_tokens`, out-of-vocabulary ids), sent to the engine core as EngineCoreRequests
carrying PoolingParams, and the pooled vectors come back with the requests' finish. `score` is
vLLM's: for a cross-encoder (a classifier with one label) each pair is one prompt
(`text_1 [SEP] text_2`), for an embedding model it is the cosine of the two embeddings. One
`text_1` scores against every `text_2` (one-to-many); otherwise the lists pair up.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ember.pooling.inputs import tokenize_prompts, verify_params
from ember.pooling.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from ember.pooling.params import PoolingParams

if TYPE_CHECKING:
    from ember.entrypoints.llm import LLM


def is_classifier(llm: LLM) -> bool:
    from ember.pooling.inputs import is_classifier as classifier

    return classifier(llm.llm_engine.model_config)


def check_pooling_model(llm: LLM, what: str) -> None:
    cfg = llm.llm_engine.model_config
    if cfg.runner != "pooling":
        raise ValueError(f"LLM.{what} needs a pooling model, but {cfg.architecture} runs as a "
                         "generative model: create the LLM with runner='pooling' (embeddings from "
                         "a decoder) or use a pooling model; LLM.generate is for this one")


def _params_list(params: PoolingParams | Sequence[PoolingParams] | None, n: int,
                 truncate: int | None, task: str, llm: LLM) -> list[PoolingParams]:
    if params is None:
        params = PoolingParams()
    if isinstance(params, PoolingParams):
        plist = [params] * n
    else:
        plist = list(params)
        if len(plist) != n:
            raise ValueError(f"got {len(plist)} PoolingParams for {n} prompts: give one, or one "
                             "per prompt")
    cfg = llm.llm_engine.model_config
    seen: dict[int, PoolingParams] = {}
    out = []
    for p in plist:
        if id(p) not in seen:
            seen[id(p)] = verify_params(p, task, cfg, truncate)
        out.append(seen[id(p)])
    return out


def _tokenize(llm: LLM, prompts: list[Any], plist: list[PoolingParams],
              pairs: list[tuple[str, str]] | None = None) -> list[list[int]]:
    """Token ids per prompt (pairs: with each pair's second-segment start in its params)."""
    engine = llm.llm_engine
    return tokenize_prompts(engine.get_tokenizer(), prompts, plist, engine.max_model_len,
                            engine.model_config.vocab_size, pairs,
                            check_keys=engine.processor.check_prompt_keys)


def run_pooling(llm: LLM, prompts: Any, params: Any, truncate: int | None, task: str,
                use_tqdm: bool | Callable[..., Any], pairs: list[tuple[str, str]] | None = None
                ) -> list[PoolingRequestOutput]:
    check_pooling_model(llm, task)
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    prompts = list(prompts)
    if not prompts:
        return []
    plist = _params_list(params, len(prompts), truncate, task, llm)
    ids = _tokenize(llm, prompts, plist, pairs)
    from ember.core.messages import EngineCoreRequest
    from ember.sampling_params import SamplingParams

    engine = llm.llm_engine
    engine.check_awake()
    sp = SamplingParams(max_tokens=1)
    now = time.time()
    req_ids = [f"pool-{next(llm._counter)}" for _ in prompts]
    reqs = [EngineCoreRequest(rid, toks, sp, [], now, pooling_params=p)
            for rid, toks, p in zip(req_ids, ids, plist)]
    client = engine.client
    client.add_requests(reqs)
    results: dict[str, Any] = {}
    bar = _bar(use_tqdm, len(reqs))
    try:
        while len(results) < len(reqs):
            for batch in _next_outputs(client):
                if batch.engine_error is not None:
                    raise client.fail(batch.engine_error)
                for out in batch.outputs:
                    if out.pooled is not None and out.request_id not in results:
                        results[out.request_id] = out.pooled
                        if bar is not None:
                            bar.update(1)
    except BaseException:
        client.abort_requests([r for r in req_ids if r not in results])
        raise
    finally:
        if bar is not None and hasattr(bar, "close"):
            bar.close()
    import torch

    return [PoolingRequestOutput(rid, PoolingOutput(torch.frombuffer(bytearray(results[rid]),
                                                                     dtype=torch.float32)), toks)
            for rid, toks in zip(req_ids, ids)]


def _next_outputs(client) -> list:
    if not client.multiprocess:
        return [client.step()]
    batches = client.take_pending()
    if not batches:
        first = client.recv()
        batches = [first] if first is not None else []
    return batches


def _bar(use_tqdm: bool | Callable[..., Any], total: int):
    from ember import envs

    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
    if use_tqdm and not envs.disable_progress_bars():
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
    return None


# ---- the LLM methods ----------------------------------------------------------------------
def embed(llm: LLM, prompts, pooling_params=None, truncate_prompt_tokens=None,
          use_tqdm=True) -> list[EmbeddingRequestOutput]:
    check_pooling_model(llm, "embed")
    if is_classifier(llm):
        arch = llm.llm_engine.model_config.architecture
        raise ValueError(f"LLM.embed needs an embedding model; {arch} is a classifier: use "
                         "LLM.classify or LLM.score")
    outs = run_pooling(llm, prompts, pooling_params, truncate_prompt_tokens, "embed", use_tqdm)
    return [EmbeddingRequestOutput.from_base(o) for o in outs]


def classify(llm: LLM, prompts, pooling_params=None, truncate_prompt_tokens=None,
             use_tqdm=True) -> list[ClassificationRequestOutput]:
    check_pooling_model(llm, "classify")
    if not is_classifier(llm):
        raise ValueError(f"LLM.classify needs a classification model (*ForSequenceClassification"
                         f"); {llm.llm_engine.model_config.architecture} gives embeddings: use "
                         "LLM.embed")
    outs = run_pooling(llm, prompts, pooling_params, truncate_prompt_tokens, "classify", use_tqdm)
    return [ClassificationRequestOutput.from_base(o) for o in outs]


def encode(llm: LLM, prompts, pooling_params=None, truncate_prompt_tokens=None,
           use_tqdm=True) -> list[PoolingRequestOutput]:
    """The pooled output as the model's task gives it (embedding, or class probabilities)."""
    return run_pooling(llm, prompts, pooling_params, truncate_prompt_tokens, "encode", use_tqdm)


def score(llm: LLM, text_1, text_2, truncate_prompt_tokens=None, use_tqdm=True,
          pooling_params=None) -> list[ScoringRequestOutput]:
    check_pooling_model(llm, "score")
    t1 = [text_1] if isinstance(text_1, str) else list(text_1)
    t2 = [text_2] if isinstance(text_2, str) else list(text_2)
    if not t1 or not t2:
        raise ValueError("score needs at least one text on each side")
    if len(t1) == 1:
        t1 = t1 * len(t2)
    elif len(t1) != len(t2):
        raise ValueError(f"score: text_1 has {len(t1)} texts and text_2 {len(t2)}: give one "
                         "text_1 (scored against every text_2) or equally many")
    for t in t1 + t2:
        if not isinstance(t, str):
            raise ValueError(f"score takes strings, got {type(t).__name__}")
        if not t:
            raise ValueError("score: a text is empty")
    if is_classifier(llm):
        labels = getattr(llm.llm_engine.model_config.hf_config, "num_labels", 1)
        if labels != 1:
            raise ValueError(f"score needs a cross-encoder with one label; this classifier has "
                             f"{labels}: use LLM.classify")
        pairs = list(zip(t1, t2))
        outs = run_pooling(llm, [p[0] for p in pairs], pooling_params, truncate_prompt_tokens,
                           "score", use_tqdm, pairs=pairs)
        return [ScoringRequestOutput.from_base(o) for o in outs]
    if pooling_params is not None and pooling_params.use_activation is not None:
        raise ValueError("use_activation has no effect when scoring with an embedding model "
                         "(cosine similarity)")
    import torch.nn.functional as F

    uniq = list(dict.fromkeys(t1 + t2))
    # normalize does not change a cosine; dimensions does (Matryoshka), as in vLLM.
    embs = run_pooling(llm, uniq, pooling_params, truncate_prompt_tokens, "embed", use_tqdm)
    by_text = {t: o for t, o in zip(uniq, embs)}
    out = []
    for a, b in zip(t1, t2):
        ea, eb = by_text[a], by_text[b]
        value = float(F.cosine_similarity(ea.outputs.data, eb.outputs.data, dim=0))
        out.append(ScoringRequestOutput(f"score-{next(llm._counter)}", ScoringOutput(value),
                                        ea.prompt_token_ids + eb.prompt_token_ids))
    return out
