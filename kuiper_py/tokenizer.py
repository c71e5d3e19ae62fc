"""Tokenizer (Hugging Face fast tokenizer from the trailer), chat template and streaming detokenization."""
from __future__ import annotations

from .errors import KuiperError


class ChatTokenizer:
    def __init__(self, trailer: dict | None):
        from tokenizers import Tokenizer

        tok_json = (trailer or {}).get("tokenizer")
        if not tok_json:
            raise KuiperError("model file carries no tokenizer: pass --tokenizer HF_DIR (a directory with tokenizer.json)")
        try:
            self.tok = Tokenizer.from_str(tok_json)
        except Exception as e:  # the tokenizers library raises its own Exception subclass
            raise KuiperError(f"model's tokenizer.json cannot be read: {e}") from None
        self.config = (trailer or {}).get("tokenizer_config") or {}
        self.template = self.config.get("chat_template")
        if isinstance(self.template, list):  # named templates: take the default one
            self.template = next((t["template"] for t in self.template if t.get("name") == "default"), None)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of text; text that is not Unicode (a lone surrogate: JSON's \\ud800, a non-UTF-8 argv byte)
        is the caller's error."""
        try:
            return self.tok.encode(text, add_special_tokens=False).ids
        except TypeError:
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise KuiperError(f"the text is not valid Unicode: it holds the unpaired surrogate "
                                  f"{e.object[e.start]!r} (a byte that is not UTF-8?)") from None
            raise

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    def token_id(self, text: str) -> int | None:
        return self.tok.token_to_id(text)

    def apply_chat_template(self, messages: list[dict], enable_thinking: bool | None = None,
                            tools: list[dict] | None = None, extra: dict | None = None) -> str:
        """The conversation rendered for generation. tools: OpenAI-style function definitions, which templates
        that know tools (Qwen3's) list in the system turn; extra: more template variables (an API request's
        chat_template_kwargs), which do not override the ones set here."""
        ctx = {**(extra or {}), "messages": messages, "add_generation_prompt": True, "bos_token": "",
               "eos_token": self.config.get("eos_token") or ""}
        if enable_thinking is not None:
            ctx["enable_thinking"] = enable_thinking
        if tools:
            ctx["tools"] = tools
        import jinja2
        try:
            return self._compiled_template().render(**ctx)
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as e:
            # (a message or tool the template cannot take: the caller's input, not a bug)
            raise KuiperError(f"chat template failed: {e}") from None

    @property
    def template_knows_tools(self) -> bool:
        """Whether the chat template reads a `tools` variable (else tool definitions would be dropped)."""
        return bool(self.template) and "tools" in self.template

    def _compiled_template(self):
        """The chat template compiled once (a chat renders the whole conversation every turn)."""
        if getattr(self, "_jinja", None) is None:
            if not self.template:
                raise KuiperError("model has no chat template: use --raw")
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            def raise_exception(msg):
                raise jinja2.TemplateError(msg)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = _tojson  # (Jinja's own sorts keys and escapes HTML; templates expect HF's)
            try:
                self._jinja = env.from_string(self.template)
            except jinja2.TemplateError as e:
                raise KuiperError(f"chat template failed: {e}") from None
        return self._jinja


def _tojson(x, indent=None, separators=None, sort_keys=False):
    """Hugging Face's tojson for chat templates: keys in their order, non-ASCII kept."""
    import json
    return json.dumps(x, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)


class StreamDecoder:
    """Incremental detokenization that only emits text once it is valid UTF-8.

    A byte-level BPE token can end inside a multi-byte character; decoding the
    unfinished tail gives U+FFFD, so text is held back until the character completes.
    """

    def __init__(self, tokenizer: ChatTokenizer):
        self.t = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the window we re-decode (for context-dependent spacing)
        self.read = 0  # ids up to here have been emitted

    def push(self, token: int) -> str:
        self.ids.append(token)
        prev = self.t.decode(self.ids[self.prefix:self.read])
        text = self.t.decode(self.ids[self.prefix:])
        if len(text) > len(prev) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(prev):]
        return ""

    def flush(self) -> str:
        """Whatever is held back at the end (may contain U+FFFD if generation stopped mid-character)."""
        prev = self.t.decode(self.ids[self.prefix:self.read])
        text = self.t.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(prev):]
