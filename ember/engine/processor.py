"""InputProcessor: a prompt and its SamplingParams -> validated token ids and engine-core requests.

Runs in the caller's thread (the event loop in the server) so a bad prompt is the caller's
ValueError before anything reaches the engine core. A parent request with n > 1 becomes n child
requests; the core never hears of parents. Prompt dict keys the engine cannot honour are refused
by name (ember.inputs), `truncate_prompt_tokens` keeps the prompt's last k tokens, and a non-zero
`priority` needs scheduling_policy="priority" (vLLM's rules).
"""

from __future__ import annotations

from ember.config import ModelConfig
from ember.core.messages import EngineCoreRequest
from ember.inputs import PROMPT_KEYS, REFUSED_PROMPT_KEYS, PromptType
from ember.logits_processors.validation import validate_request_params
from ember.sampling_params import SamplingParams


def child_request_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{index}_{request_id}"


class InputProcessor:
    def __init__(self, model_config: ModelConfig, tokenizer,
                 scheduling_policy: str = "fcfs") -> None:
        self.model_config = model_config
        self.scheduling_policy = scheduling_policy
        self.max_model_len = model_config.max_model_len
        self.vocab_size = model_config.vocab_size
        self.tokenizer = tokenizer
        self.eos_token_ids = model_config.eos_token_ids(tokenizer)
        self._eos_list = sorted(self.eos_token_ids)

    @staticmethod
    def check_prompt_keys(prompt: dict) -> str | None:
        """Refuse keys that would be ignored; returns the prompt's cache_salt."""
        refused = [k for k in prompt if k in REFUSED_PROMPT_KEYS and prompt[k] is not None]
        if refused:
            reasons = "; ".join(f"{k}: {REFUSED_PROMPT_KEYS[k]}" for k in refused)
            raise ValueError(f"unsupported prompt field(s) {', '.join(refused)} ({reasons})")
        unknown = sorted(str(k) for k in prompt if k not in PROMPT_KEYS and k not in REFUSED_PROMPT_KEYS)
        if unknown:
            raise ValueError(
                f"unknown prompt field(s): {', '.join(unknown)}; a prompt dict takes "
                f"{', '.join(sorted(PROMPT_KEYS))}"
            )
        salt = prompt.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
        return salt

    def prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            self.check_prompt_keys(prompt)
        if isinstance(prompt, str):
            text, ids = prompt, None
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text, ids = prompt["prompt"], None
        else:
            raise ValueError(
                "prompt must be a string, a TextPrompt {'prompt': ...} or a TokensPrompt "
                f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}"
            )
        if ids is None:
            if not isinstance(text, str):
                raise ValueError(f"prompt text must be a string, got {type(text).__name__}")
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True was set)")
            ids = self.tokenizer.encode(text) if text else []
        return text, ids

    def validate_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt (length {len(ids)}) is longer than the maximum model length of "
                f"{self.max_model_len} minus one token for the output"
            )
        vocab = self.vocab_size
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of vocabulary [0, {vocab}): {bad[:5]}")

    def process(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None,
        arrival_time: float,
        client_index: int = 0,
        priority: int = 0,
    ) -> tuple[str | None, list[int], SamplingParams, list[EngineCoreRequest]]:
        """(prompt text, prompt ids, the parent's params, one core request per child)."""
        if self.model_config.runner == "pooling":  # LLM.generate, AsyncLLM and the server alike
            raise ValueError(f"{self.model_config.architecture} runs as a pooling model: it "
                             "cannot generate text; use LLM.embed / classify / score / encode")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        self.check_priority(priority)
        text, ids = self.prompt_ids(prompt)
        salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        ids = self.truncate(ids, params.truncate_prompt_tokens)
        self.validate_prompt(ids)
        validate_request_params(params, vocab_size=self.vocab_size, tokenizer=self.tokenizer,
                                max_logprobs=self.model_config.max_logprobs,
                                structured_outputs_config=self.model_config.structured_outputs)
        children = []
        for index in range(params.n):
            child = self.child_params(params, index, len(ids))
            children.append(EngineCoreRequest(
                child_request_id(request_id, index, params.n), ids, child, self._eos_list,
                arrival_time, sorted(child.all_stop_token_ids), client_index, priority, salt,
            ))
        return text, ids, params, children

    def check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if priority != 0 and self.scheduling_policy != "priority":
            raise ValueError(
                f"got priority {priority} but priority scheduling is not enabled: "
                "set scheduling_policy='priority'"
            )

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep the last `keep` tokens (-1: max_model_len)."""
        if keep is None:
            return ids
        if keep == -1:
            keep = self.max_model_len
        elif keep > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens={keep} is greater than max_model_len={self.max_model_len}"
            )
        return ids[-keep:]

    def child_params(self, params: SamplingParams, index: int, prompt_len: int) -> SamplingParams:
        child = params.clone()
        child.n = 1
        if child.max_tokens is None:
            child.max_tokens = self.max_model_len - prompt_len
        if index > 0:
            # Only one child reports prompt logprobs; distinct seeds keep the n samples distinct.
            child.prompt_logprobs = None
            if child.seed is not None:
                child.seed = child.seed + index
        # The sampler masks these while min_tokens is not reached (vLLM adds eos the same way).
        child.all_stop_token_ids = set(child.stop_token_ids)
        if not child.ignore_eos:
            child.all_stop_token_ids |= self.eos_token_ids
        return child
