"""The built-in reasoning parsers (vLLM's names): qwen3 and deepseek_r1, both ``<think>…</think>``.

They differ only where the output starts when the prompt cannot tell (no ``prompt=`` given):
- qwen3: Qwen3's own template lets the model write ``<think>``; an output without it is an answer
  (Qwen3 with thinking off). The 2507 thinking models' template puts ``<think>`` in the prompt:
  give the prompt and the parser sees it.
- deepseek_r1: DeepSeek-R1's template ends the prompt with ``<think>\\n``, so an output is
  reasoning until ``</think>`` (all reasoning if it never comes, as in vLLM).
"""

from __future__ import annotations

from ember.reasoning.parser import ThinkTagReasoningParser


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    starts_in_reasoning = False


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    starts_in_reasoning = True
