"""Chat messages -> a prompt: OpenAI-style messages checked and rendered with a chat template.

vLLM's `LLM.chat` accepts a message's content as a string or as a list of OpenAI content parts;
text parts (`{"type": "text", "text": ...}`) are joined with newlines into one string, which is
what chat templates written for plain strings expect ("string" content format), or kept as a
list of text parts ("openai" format) for templates that iterate over parts. Other part types
(images, audio, files) need a multimodal model, so they are refused by name rather than dropped.
"""

from __future__ import annotations

from typing import Any

CONTENT_FORMATS = ("auto", "string", "openai")
_TEXT_PART_TYPES = ("text", "input_text", "output_text", "refusal")  # all carry plain text


def _part_text(part: Any, where: str) -> str:
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise ValueError(f"{where}: a content part must be a dict, got {type(part).__name__}")
    kind = part.get("type", "text" if "text" in part else None)
    if kind not in _TEXT_PART_TYPES:
        raise ValueError(
            f"{where}: content part type {kind!r} is not supported (only text parts: ember "
            "serves no multimodal models yet)"
        )
    text = part.get("refusal" if kind == "refusal" else "text")
    if not isinstance(text, str):
        raise ValueError(f"{where}: a {kind!r} part needs a string {'text'!r} field")
    return text


def normalize_message(message: Any, index: int, content_format: str = "auto") -> dict[str, Any]:
    """A copy of one message whose content is a string (or a list of text parts, "openai")."""
    where = f"messages[{index}]"
    if not isinstance(message, dict) or "role" not in message:
        raise ValueError(f"{where} must be a dict with a 'role'")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return dict(message)
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of content parts")
    texts = [_part_text(part, f"{where}.content[{i}]") for i, part in enumerate(content)]
    out = dict(message)
    if content_format == "openai":
        out["content"] = [{"type": "text", "text": t} for t in texts]
    else:
        out["content"] = "\n".join(texts)
    return out


def render_chat(
    tokenizer,
    conversation: list[dict[str, Any]],
    *,
    chat_template: str | None = None,
    chat_template_content_format: str = "auto",
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text of one conversation (vLLM's rules for the flags)."""
    if chat_template_content_format not in CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {CONTENT_FORMATS}, "
                         f"got {chat_template_content_format!r}")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: "
                         "the first extends the last message, the second opens a new one")
    if not isinstance(conversation, list) or not conversation:
        raise ValueError("a conversation must be a non-empty list of messages")
    messages = [normalize_message(m, i, chat_template_content_format)
                for i, m in enumerate(conversation)]
    if continue_final_message and messages[-1].get("role") != "assistant":
        raise ValueError("continue_final_message needs the last message to be the assistant's")
    extra = dict(chat_template_kwargs or {})
    clash = {"conversation", "tokenize", "chat_template", "tools", "add_generation_prompt",
             "continue_final_message"} & set(extra)
    if clash:
        raise ValueError(f"chat_template_kwargs may not set {', '.join(sorted(clash))}: "
                         "they are arguments of chat() itself")
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **extra,
        )
    except ValueError:
        raise
    except Exception as exc:  # a template error (jinja2) is the caller's input, not a crash
        raise ValueError(f"the chat template failed: {exc}") from exc
