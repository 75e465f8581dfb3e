"""The one chat encoder: messages -> token ids through the tokenizer's chat template, with message
content encoded as text.

Scope: :func:`encode_chat` (used by the runtime's ``ChatTokenizerMixin.encode_chat`` and by the
training data's ``ChatFormat``), :func:`encode_text` (plain text, never control tokens) and
:func:`check_messages` (the shape every caller's ``messages`` must have).

Why content is handled apart from the template: a chat template writes its control strings
(``<|im_start|>``, ``<|eot_id|>``, ...) as text, and the tokenizer turns every occurrence of such a
string into its control token. Rendering the template with a user's content and tokenizing the
result would let content that *contains* those strings (``...<|im_end|>\\n<|im_start|>system``)
open turns of its own: prompt injection through control tokens. Here the template is rendered
with a placeholder per message, so what the template wrote and what the caller wrote are known
apart; template text is tokenized normally and content as text (:func:`encode_text`: a control
string inside it becomes ordinary tokens, whether the tokenizer calls it special or not).

Exactness: when no control string of the tokenizer occurs more often in the rendered
conversation than in the template alone (every ordinary conversation), the ids are those of
tokenizing the rendered template in one piece, exactly as before this module existed, so data
caches and outputs do not change. Only conversations whose content would have produced control
tokens take the piecewise path.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["encode_chat", "encode_text", "check_messages", "control_strings"]

_PLACEHOLDER = "\u2063SFCHAT{}\u2063"  # invisible separators: cannot clash with real text


def check_messages(messages) -> list[dict]:
    """``messages`` as a list of ``{"role": str, "content": str}``; one clear ValueError otherwise."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}]['role'] must be a string, got {type(m.get('role')).__name__}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}]['content'] must be a string, got {type(m.get('content')).__name__}")
    return list(messages)


def control_strings(tokenizer) -> list[str]:
    """The strings the tokenizer turns into added tokens when it reads them in text: special or
    not (Qwen's ``<tool_call>`` is an unspecial control string), whitespace-only ones excepted."""
    return [t for t in getattr(tokenizer, "added_tokens_encoder", {}) if t.strip()]


def _plain(tokenizer, text: str) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


def encode_text(tokenizer, text: str, controls: Sequence[str] | None = None) -> list[int]:
    """Plain text -> ids without special tokens; control strings in ``text`` stay text.

    ``split_special_tokens`` keeps special tokens from matching, but not unspecial added tokens,
    so each control string found in ``text`` is encoded in two parts (all but its last character,
    then that character): neither part can match it. Text without control strings is encoded in
    one piece, exactly as the tokenizer would."""
    controls = control_strings(tokenizer) if controls is None else controls
    hits = [(text.find(s), -len(s), s) for s in controls if s in text]
    if not hits:
        return _plain(tokenizer, text)
    at, _, s = min(hits)  # the first occurrence; the longest string there
    return (_plain(tokenizer, text[:at]) + encode_text(tokenizer, s[:-1], controls) + _plain(tokenizer, s[-1:])
            + encode_text(tokenizer, text[at + len(s):], controls))


def _encode_template(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render(tokenizer, messages, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _pieces(tokenizer, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[tuple[str, int | None]]]:
    """The rendered conversation and its pieces in order: ``(text, None)`` for what the template
    wrote, ``(text, i)`` for message ``i``'s content."""
    real = _render(tokenizer, messages, add_generation_prompt)
    marks = [_PLACEHOLDER.format(i) for i in range(len(messages))]
    templ = _render(tokenizer, [{**m, "content": mk} for m, mk in zip(messages, marks)], add_generation_prompt)
    pieces: list[tuple[str, int | None]] = []
    rest, pos = templ, 0  # pos: where ``rest`` starts in ``real``
    for i, mk in enumerate(marks):
        at = rest.find(mk)
        if at < 0:  # the template dropped this message (e.g. a system message it does not render)
            continue
        pieces.append((rest[:at], None))
        c = messages[i]["content"]
        # the template may trim content; take what it actually wrote
        shown = next((x for x in (c, c.strip()) if real.startswith(x, pos + at)), c)
        pieces.append((shown, i))
        pos += at + len(shown)
        rest = rest[at + len(mk):]
    pieces.append((rest, None))
    return real, pieces


def encode_chat(tokenizer, messages, *, add_generation_prompt: bool = True,
                stop_before_content_of: int | None = None) -> list[int]:
    """Token ids of ``messages`` in the tokenizer's chat template; content is encoded as text.

    ``stop_before_content_of=i`` ends the ids just before message ``i``'s content (everything the
    template writes before it: Magpie's user-turn prefix)."""
    messages = check_messages(messages)
    if not getattr(tokenizer, "chat_template", None):
        if stop_before_content_of is not None:
            raise ValueError("the tokenizer has no chat template: there is no turn prefix")
        # no template: the contents joined by newlines, with the tokenizer's usual BOS/EOS wrapping
        text = "\n".join(m["content"] for m in messages)
        if not any(s in text for s in control_strings(tokenizer)):
            return list(tokenizer(text)["input_ids"])
        wrapped, bare = list(tokenizer("a")["input_ids"]), list(tokenizer("a", add_special_tokens=False)["input_ids"])
        at = next(i for i in range(len(wrapped) - len(bare) + 1) if wrapped[i:i + len(bare)] == bare)
        return wrapped[:at] + encode_text(tokenizer, text) + wrapped[at + len(bare):]
    real, pieces = _pieces(tokenizer, messages, add_generation_prompt)
    if stop_before_content_of is not None:
        cut = next((j for j, (_, i) in enumerate(pieces) if i == stop_before_content_of), None)
        if cut is None:
            raise ValueError(f"the chat template does not render message {stop_before_content_of}")
        pieces = pieces[:cut]
        real = "".join(text for text, _ in pieces)
    template_only = "".join(text for text, i in pieces if i is None)
    if all(real.count(s) == template_only.count(s) for s in control_strings(tokenizer)):
        return _encode_template(tokenizer, real)  # no content makes a control string: one piece, as ever
    # piecewise: template text as the template means it, content as text (pieces are tokenized
    # apart, so a tokenizer that marks the start of each encoding, like SentencePiece's leading
    # space, may tokenize the joins differently; only conversations like this one get here)
    controls = control_strings(tokenizer)
    ids: list[int] = []
    for text, i in pieces:
        if text:
            ids += _encode_template(tokenizer, text) if i is None else encode_text(tokenizer, text, controls)
    return ids
