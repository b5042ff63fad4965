"""Text in and out of the tokenizer: chat prompts, and generated text streamed piece by piece.

Chat messages go through the tokenizer's own chat template; a tokenizer without one (the
reference model has none) gets `DEFAULT_CHAT_TEMPLATE`, which writes each message as
"role: content" on its own line and ends with "assistant:" for the reply.

`TextStream` turns a sequence's tokens into text deltas. It decodes the whole output each time
(a byte-level BPE token can be part of a character, and one token's text can depend on its
neighbours), and holds back what may still change: a trailing incomplete character ("\\ufffd")
and a tail that could be the start of a stop string. Text stops before the first stop string
(once the request's `min_tokens` are out).
"""

from __future__ import annotations

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def chat_prompt(tokenizer, messages: list[dict[str, str]]) -> str:
    """The prompt text of `messages` under the tokenizer's template (or the default one)."""
    template = None if getattr(tokenizer, "chat_template", None) else DEFAULT_CHAT_TEMPLATE
    return tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # the output so far, cut before a stop string once one appears
        self.emitted = ""  # the part of `text` handed out as deltas
        self.stopped = False  # a stop string appeared
        self.unchecked = 0  # the text's length when stop strings began to count (`min_tokens`)

    def add(self, token_id: int, stops: bool = True) -> str:
        """Take one generated token; returns the new text that is safe to hand out now. With
        `stops` False (before a request's `min_tokens`) no stop string ends the text, and later a
        stop string is looked for only where it could end past this token's text, as vLLM does."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if not stops:
            self.unchecked = len(text)
        cut = -1 if not stops else min((i for i in (text.find(s, max(0, self.unchecked - len(s) + 1))
                                                    for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self.flush()
        self.text = text
        return self._delta(len(text) - self._unsafe_tail(text))

    def flush(self) -> str:
        """The sequence ended: whatever is left."""
        return self._delta(len(self.text))

    def _delta(self, end: int) -> str:
        if end <= len(self.emitted) or not self.text.startswith(self.emitted):
            return ""  # nothing new, or the decoding of text already handed out changed (never retracted)
        delta = self.text[len(self.emitted):end]
        self.emitted += delta
        return delta

    def _unsafe_tail(self, text: str) -> int:
        """How many trailing characters may still change: an incomplete character, or a tail that
        begins a stop string."""
        tail = len(text) - len(text.rstrip("\ufffd"))
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    tail = max(tail, n)
                    break
        return tail
