"""Chat messages → prompt text, through a tokenizer's chat template (a Jinja template, as transformers'
`apply_chat_template` renders it: a sandboxed environment with trim_blocks and lstrip_blocks, the
variables `messages`, `add_generation_prompt`, `bos_token`, `eos_token`, and `raise_exception`).

The template comes from a `tokenizer_config.json` (its `chat_template`: a string, or a list of named
templates of which "default" is taken), from a template file, or is the default for a model without one
(the byte-level passkey model): the messages' contents joined as they are, `DEFAULT_TEMPLATE`, so a user
message holding a passkey prompt is exactly that prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
ROLES = ("system", "user", "assistant", "tool", "developer")


class ChatTemplate:
    def __init__(self, source: str = DEFAULT_TEMPLATE, *, bos_token: str = "", eos_token: str = ""):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"chat_template: does not parse as a Jinja template ({e})") from e
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token

    @classmethod
    def from_tokenizer_config(cls, path) -> "ChatTemplate":
        """The template of a tokenizer_config.json (ValueError naming the file if it has none)."""
        template, _ = read_tokenizer_config(path)
        if template is None:
            raise ValueError(f"tokenizer_config: {str(path)!r}: expected a 'chat_template' string (or a list with "
                             "one named 'default')")
        return template

    @classmethod
    def from_file(cls, path) -> "ChatTemplate":
        try:
            return cls(Path(path).read_text())
        except OSError as e:
            raise ValueError(f"chat_template: {str(path)!r}: expected a readable Jinja file ({e})") from e

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages` ([{"role", "content"}]; ValueError when the template refuses them)."""
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as e:
            raise ValueError(f"messages: the chat template refused them: {e}") from e


def read_tokenizer_config(path) -> tuple["ChatTemplate | None", str]:
    """(its chat template or None, its EOS token's text or "") of a tokenizer_config.json."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"tokenizer_config: {str(path)!r}: expected a readable JSON file ({e})") from e
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    eos = _token_text(config.get("eos_token"))
    if not isinstance(source, str) or not source:
        return None, eos
    return ChatTemplate(source, bos_token=_token_text(config.get("bos_token")), eos_token=eos), eos


def _token_text(token) -> str:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(token, dict):
        return str(token.get("content", ""))
    return token or ""
