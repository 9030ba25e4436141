"""PoolingParams: what a pooling request asks for (vLLM's fields), checked against its task.

A msgspec struct, so it crosses to an engine-core process with the request. Every field has its
vLLM effect or is refused: `normalize` (embed: L2 after truncation), `dimensions` (embed:
Matryoshka truncation to the first k values), `use_activation` (classify / score: sigmoid for one
label, softmax for several; `activation` is vLLM's older spelling of it) and
`truncate_prompt_tokens` (keep the last k tokens; -1: max_model_len).
"""

from __future__ import annotations

import msgspec

TASKS = ("encode", "embed", "classify", "score")
_TASK_FIELDS = {
    "embed": {"dimensions", "normalize"},
    "encode": {"dimensions", "normalize"},
    "classify": {"use_activation"},
    "score": {"use_activation"},
}


class PoolingParams(msgspec.Struct, omit_defaults=True, array_like=True):
    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None
    activation: bool | None = None  # vLLM's older name for use_activation
    task: str | None = None  # set by LLM.embed / classify / score / encode
    # Internal: where the second segment of a sentence pair starts (BERT token_type_ids = 1 from
    # there on), for cross-encoder scoring; None: one segment.
    pair_start: int | None = None

    def clone(self) -> PoolingParams:
        return msgspec.structs.replace(self)

    def verify(self, task: str, hidden_size: int | None = None,
               matryoshka: bool | list[int] | None = None,
               model_kind: str | None = None) -> PoolingParams:
        """A copy for `task`, with every field this task cannot honour refused by name
        ("encode" takes the fields of the model's own kind, "embed" or "classify", when given)."""
        if task not in TASKS:
            raise ValueError(f"unknown pooling task {task!r}; valid: {', '.join(TASKS)}")
        params = self.clone()
        if params.activation is not None:
            if params.use_activation is not None and params.use_activation != params.activation:
                raise ValueError("activation and use_activation disagree: give use_activation")
            params.use_activation, params.activation = params.activation, None
        if params.task is not None and params.task != task:
            raise ValueError(f"these PoolingParams are for task {params.task!r}, not {task!r}")
        params.task = task
        given = {f for f in ("dimensions", "normalize", "use_activation")
                 if getattr(params, f) is not None}
        allowed = _TASK_FIELDS[model_kind if task == "encode" and model_kind else task]
        refused = sorted(given - allowed)
        if refused:
            on = ""
            if task == "encode" and model_kind:
                on = " on a classifier" if model_kind == "classify" else " on an embedding model"
            raise ValueError(f"{', '.join(refused)} cannot be used with task {task!r}{on} "
                             f"(it takes {', '.join(sorted(allowed))})")
        if params.dimensions is not None:
            if not isinstance(params.dimensions, int) or params.dimensions < 1:
                raise ValueError(f"dimensions must be a positive integer, got {params.dimensions!r}")
            if not matryoshka:
                raise ValueError("dimensions is not supported: the model does not declare "
                                 "Matryoshka representations (is_matryoshka / "
                                 "matryoshka_dimensions in its config)")
            if isinstance(matryoshka, list) and params.dimensions not in matryoshka:
                raise ValueError(f"dimensions={params.dimensions} is not one of the model's "
                                 f"matryoshka_dimensions {matryoshka}")
            if hidden_size is not None and params.dimensions > hidden_size:
                raise ValueError(f"dimensions={params.dimensions} exceeds the embedding size "
                                 f"{hidden_size}")
        keep = params.truncate_prompt_tokens
        if keep is not None and (not isinstance(keep, int) or isinstance(keep, bool)
                                 or (keep < 1 and keep != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or >= 1, got {keep!r}")
        return params
