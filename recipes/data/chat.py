"""Conversations as token ids with the loss on the answers only (``task: sft``).

A conversation is a list of messages ``{"role": "system" | "user" | "assistant", "content": str}``.
It is rendered with a chat template (Jinja, as Hugging Face writes them): the tokenizer's own when
it has one (a Hugging Face folder's ``chat_template.jinja`` or ``tokenizer_config.json``), rendered
by ``transformers``' ``apply_chat_template``; else :data:`DEFAULT_TEMPLATE`, plain text. Each
assistant message is what the template adds for it: the rendering of ``messages[:i + 1]`` beyond
that of ``messages[:i]`` with the generation prompt (the model's turn opened); those tokens, and
the EOS a template without an end of turn of its own is followed by, are the targets of the loss;
the rest (system, user turns, the template's framing) is context. Each piece of text is encoded
on its own, so a token never straddles an answer's edge, and a prompt encoded for generation is
the training's context token for token.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

import numpy as np

from yamlformer.recipes.errors import RecipeError

ROLES = ("system", "user", "assistant")
#: the template of a tokenizer without one (sentencepiece, char, a folder without a chat
#: template): Alpaca's headers, each turn ended by a blank line; the tokenizer's EOS ends each answer
DEFAULT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '### Instruction:\\n' + message['content'] + '\\n\\n' }}"
    "{% else %}{{ '### Response:\\n' + message['content'] + '\\n\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Response:\\n' }}{% endif %}"
)


class ChatError(ValueError):
    """A conversation that cannot be rendered or trained: says why, never its text."""


def conversation(record) -> list[dict]:
    """The messages of one record: ``{"prompt", "response"}`` (and an optional ``"system"``) or
    ``{"messages": [...]}``; :class:`ChatError` saying what is wrong with it."""
    if not isinstance(record, dict):
        raise ChatError(f"a {type(record).__name__}, not an object with prompt/response or messages")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ChatError("messages is not a list of messages")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or message.get("role") not in ROLES:
                raise ChatError(f"messages[{i}] has no role of {', '.join(ROLES)}")
            if not isinstance(message.get("content"), str):
                raise ChatError(f"messages[{i}].content is not a string")
        if not any(m["role"] == "assistant" for m in messages):
            raise ChatError("no assistant message: nothing to train on")
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    missing = [key for key in ("prompt", "response") if not isinstance(record.get(key), str)]
    if missing:
        names = ", ".join(repr(str(k)[:40]) for k in list(record)[:10]) or "none"
        raise ChatError(f"no string {' or '.join(missing)} and no messages (its fields: {names})")
    system = record.get("system")
    if system is not None and not isinstance(system, str):
        raise ChatError("system is not a string")
    head = [{"role": "system", "content": system}] if system else []
    return [*head, {"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["response"]}]


@dataclasses.dataclass
class Encoded:
    """A conversation's ``ids``, per token whether it is a target of the loss (``trained``), and
    where each answer starts (``starts``)."""

    ids: np.ndarray
    trained: np.ndarray
    starts: list[int]

    def __len__(self) -> int:
        return len(self.ids)


class ChatFormat:
    """Renders and encodes conversations for ``tokenizer`` (module doc). ``template``: a Jinja chat
    template to use instead of the tokenizer's own or the default."""

    def __init__(self, tokenizer, template: str | None = None):
        self.tokenizer = tokenizer
        own = getattr(tokenizer, "chat_template", None)
        if own is not None and not isinstance(own, str):  # a tokenizer_config.json's 42: no template
            raise RecipeError(f"the tokenizer's chat_template is a {type(own).__name__}, not a Jinja template")
        self.template = template or own or DEFAULT_TEMPLATE
        self.source = "recipe" if template else "tokenizer" if own else "default"
        # the default template has no end of turn: the tokenizer's EOS ends each answer
        self.eos = tokenizer.eos_id if self.template == DEFAULT_TEMPLATE else None
        self._render = _bounded(_renderer(self.template, tokenizer))

    def describe(self) -> str:
        return {
            "recipe": "the recipe's chat template",
            "tokenizer": "the tokenizer's chat template",
            "default": "the plain default chat template (the tokenizer has none)",
        }[self.source]

    def text(self, messages: Sequence[dict]) -> str:
        """``messages`` rendered whole: the text :meth:`encode` encodes, in one string."""
        return self._render(messages, False)

    def pieces(self, messages: Sequence[dict]) -> list[tuple[str, bool]]:
        """The rendering of ``messages`` as ``(text, trained)`` pieces in order."""
        whole = self._render(messages, False)
        out, cursor = [], 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            start, end = self._render(messages[:i], True), self._render(messages[: i + 1], False)
            if not (end.startswith(start) and whole.startswith(end) and len(start) >= cursor):
                raise ChatError(
                    f"the chat template renders messages[{i}] apart from the conversation before it; "
                    "an answer must be what the template adds after the generation prompt"
                )
            out += [(whole[cursor : len(start)], False), (whole[len(start) : len(end)], True)]
            cursor = len(end)
        out.append((whole[cursor:], False))
        return [(text, trained) for text, trained in out if text]

    def encode(self, messages: Sequence[dict]) -> Encoded:
        """The conversation's token ids and which of them the loss reads (module doc)."""
        return self._encoded(self.pieces(messages))

    def _encoded(self, pieces: list[tuple[str, bool]]) -> Encoded:
        encoded = self.tokenizer.encode_batch([text for text, _ in pieces])
        ids, trained, starts = [], [], []
        for (_, target), piece in zip(pieces, encoded):
            if target:
                starts.append(len(ids))
            ids += piece
            trained += [target] * len(piece)
            if target and self.eos is not None:
                ids.append(self.eos)
                trained.append(True)
        return Encoded(np.asarray(ids, dtype=np.int64), np.asarray(trained, dtype=bool), starts)

    def prompt(self, messages: Sequence[dict]) -> list[int]:
        """The ids a model answers from: ``messages`` up to their last user turn (a last assistant
        message left out), the model's turn opened, token for token as :meth:`encode` made them
        the context of that answer in training."""
        context = list(messages[:-1]) if messages and messages[-1]["role"] == "assistant" else list(messages)
        pieces = self.pieces([*context, {"role": "assistant", "content": "."}])
        answer = max(i for i, (_, trained) in enumerate(pieces) if trained)  # the stand-in, never encoded
        return self._encoded(pieces[:answer]).ids.tolist()


#: the most characters one conversation may render to: more is no record a model trains on (a
#: million-token window holds about 4 million), and tokenizing a template's ``'a' * 10**9`` took
#: 8 GB before the tokenizer aborted the process
MAX_RENDERED = 1 << 26


def _bounded(render):
    """``render``, refusing a rendering longer than :data:`MAX_RENDERED` before it is tokenized."""

    def bounded(messages, generation: bool) -> str:
        text = render(messages, generation)
        if len(text) > MAX_RENDERED:
            raise ChatError(
                f"the chat template renders {len(text):,} characters, more than the {MAX_RENDERED:,} a record may hold"
            )
        return text

    return bounded


def _renderer(template: str, tokenizer):
    """``render(messages, add_generation_prompt) -> str``: ``transformers``' ``apply_chat_template``
    for a Hugging Face tokenizer (its special tokens named), else (another tokenizer, or no
    ``transformers``) the same sandboxed Jinja environment ``transformers`` renders in."""
    state = tokenizer.state()
    if state.get("type") == "tokenizers":
        try:
            # local: transformers (optional) is asked for a Hugging Face tokenizer's chat template only
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            pass
        else:
            specials = {k: v for k, v in state.get("specials", {}).items() if isinstance(v, str)}
            hf = PreTrainedTokenizerFast(tokenizer_object=tokenizer.tokenizer, chat_template=template, **specials)

            def render(messages, generation: bool) -> str:
                try:
                    return hf.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation)
                except Exception as exc:  # a template's own raise_exception, or a Jinja error
                    raise ChatError(f"the chat template fails: {_first_line(exc)}") from None

            return render
    return _jinja(template, tokenizer)


def _jinja(template: str, tokenizer):
    """The template compiled as ``transformers`` compiles chat templates: a sandbox, blocks
    trimmed, ``raise_exception`` and ``tojson``; ``bos_token``/``eos_token`` from the tokenizer."""
    # local: jinja2 loads for a chat template only
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda value, indent=None: json.dumps(value, indent=indent, ensure_ascii=False)
    env.globals["raise_exception"] = raise_exception
    try:
        compiled = env.from_string(template)
    except TemplateError as exc:
        raise RecipeError(f"the chat template does not compile: {_first_line(exc)}") from None
    specials = {k: v for k, v in tokenizer.state().get("specials", {}).items() if isinstance(v, str)}

    def render(messages, generation: bool) -> str:
        try:
            return compiled.render(messages=list(messages), add_generation_prompt=generation, **specials)
        except TemplateError as exc:
            raise ChatError(f"the chat template fails: {_first_line(exc)}") from None

    return render


def _first_line(exc: Exception) -> str:
    """Why a template failed: Jinja's own reason, never the text of a template's own
    ``raise_exception(...)`` (the template is the user's file; ``transformers`` and
    :func:`_jinja` raise it as a bare ``TemplateError``, Jinja's own errors are subclasses)."""
    # local: jinja2 loads for a chat template only
    from jinja2 import TemplateError

    if type(exc) is TemplateError:
        return "it calls raise_exception (its message is not shown)"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:160]
