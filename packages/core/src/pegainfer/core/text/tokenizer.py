"""Text <-> token ids, and chat messages -> prompt text, for a checkpoint directory.

Wraps a `tokenizers.Tokenizer` loaded from `tokenizer.json` and renders the checkpoint's Jinja chat
template. Both must agree exactly with what transformers produces for the same directory: a prompt
that differs by one token changes the model's output. transformers itself is not imported here;
the tests hold this module to it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from pegainfer.core.errors import ConfigError, InvalidRequestError
from pegainfer.core.loading.model_files import read_json_object
from pegainfer.core.text.length_bound import max_chars_per_token, min_tokens
from pegainfer.core.text.segment_cache import SegmentCache

if TYPE_CHECKING:
    import jinja2

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

# The named special tokens transformers exposes to chat templates (its `special_tokens_map`).
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

# Names a message's reasoning arrives under; transformers copies it to `reasoning_content`
# (which most templates read) and to `thinking` (which some read).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

# Token lists up to this long are decoded holding the GIL (microseconds cheaper per call).
_SHORT_DECODE = 256


class Tokenizer:
    """A checkpoint's tokenizer and chat template(s).

    `chat_templates` maps template names to Jinja source; the unnamed template of a checkpoint is
    called "default", and a "tool_use" template, when present, is used for requests with tools.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_templates: Mapping[str, str] | None = None,
    ) -> None:
        self._backend = backend
        self._special_tokens = dict(special_tokens or {})
        # As transformers does, named special tokens that the vocabulary lacks are added to it.
        missing = [t for t in self._special_tokens.values() if backend.token_to_id(t) is None]
        if missing:
            backend.add_special_tokens([AddedToken(t, special=True) for t in missing])

        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._named_token_id("bos_token")
        self.eos_token_id: int | None = self._named_token_id("eos_token")
        self.pad_token_id: int | None = self._named_token_id("pad_token")
        added_special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        named = {backend.token_to_id(t) for t in self._special_tokens.values()}
        self.special_token_ids: frozenset[int] = frozenset(added_special | named)
        # Chat prompts tokenize per template-marker segment, their history's ids kept.
        self._segments = SegmentCache.for_tokenizer(backend)
        #: The most characters of text one token covers (None: no bound; see `length_bound`).
        #: Read here: computed on first use, it held a cold server's first requests ~0.8 s.
        self.max_chars_per_token: int | None = max_chars_per_token(backend)

        self._chat_templates: dict[str, jinja2.Template] = {}
        if chat_templates:
            # Jinja loads only for a tokenizer with templates to compile (a tenth of a second:
            # the engine process, which tokenizes only for grammars, does it off its start).
            from pegainfer.core.text.chat_template import compile_templates

            self._chat_templates = compile_templates(chat_templates)

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json`, `tokenizer_config.json` and chat templates from a checkpoint.

        Chat templates are looked up as transformers does: `chat_template.jinja` and the files in
        `additional_chat_templates/` take precedence over `chat_template` in the config, which may
        be a string or a list of `{"name", "template"}` entries.
        """
        path = Path(path)
        tokenizer_file = path / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise ConfigError(
                f"no {TOKENIZER_FILE} in {path}: pegainfer needs the fast-tokenizer file that "
                "transformers writes with `save_pretrained`; slow-only tokenizers are not supported"
            )
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise ConfigError(f"cannot load {tokenizer_file}: {e}") from e
        return cls.with_checkpoint_config(backend, path)

    @classmethod
    def with_checkpoint_config(cls, backend: BackendTokenizer, path: str | Path) -> Tokenizer:
        """`backend` (however it was built) with the named special tokens of the checkpoint's
        `tokenizer_config.json` and its chat templates (see `from_dir`)."""
        path = Path(path)
        config = read_json_object(path / TOKENIZER_CONFIG_FILE, required=False)
        special_tokens = {}
        for name in _NAMED_SPECIAL_TOKENS:
            token = _token_content(config.get(name))
            if token is not None:
                special_tokens[name] = token
        return cls(
            backend,
            special_tokens=special_tokens,
            chat_templates=_find_chat_templates(path, config),
        )

    def _named_token_id(self, name: str) -> int | None:
        token = self._special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`; `add_special_tokens` applies the tokenizer's post-processor.

        Like transformers 5, the post-processor in `tokenizer.json` decides whether a BOS/EOS is
        added (Qwen adds none); `add_bos_token`/`add_eos_token` in the config are not consulted.
        Without it, the text is tokenized per segment between special tokens and the long
        segments' ids are kept (`segment_cache`: the same ids, a conversation's history once).
        """
        if not add_special_tokens and self._segments is not None:
            return self._segments.encode(text)
        # The batch call tokenizes with the GIL released (the single one holds it: a 10 MB
        # prompt would stop every other thread, the server's event loop included, for seconds).
        return self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `token_ids`; invalid UTF-8 byte sequences decode to U+FFFD."""
        ids = list(token_ids)
        if len(ids) <= _SHORT_DECODE:  # the detokenizer's per-token calls: the cheaper call
            return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        # Long ones with the GIL released, as `encode`.
        return self._backend.decode_batch([ids], skip_special_tokens=skip_special_tokens)[0]

    @property
    def segment_cache(self) -> SegmentCache | None:
        """What `encode(text, add_special_tokens=False)` goes through (None: this tokenizer
        cannot be tokenized per segment, and such texts are tokenized whole)."""
        return self._segments

    def min_tokens(self, text: str) -> int:
        """A lower bound on `len(self.encode(text))`, found without tokenizing (0 where the
        tokenizer gives none)."""
        return min_tokens(len(text), self.max_chars_per_token)

    def to_json(self) -> str:
        """The tokenizer in `tokenizer.json`'s format (what llguidance reads), whatever it
        was loaded from."""
        return self._backend.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    def apply_chat_template(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render `messages` (OpenAI-style dicts) to prompt text, as transformers'
        `apply_chat_template(..., tokenize=False)` does.

        The result already contains the template's special tokens, so encode it with
        `add_special_tokens=False`. Extra keyword arguments (e.g. `enable_thinking`) are passed to
        the template, overriding the named special tokens of the same name.
        """
        template = self._select_template(tools)
        if not messages:
            raise InvalidRequestError("messages must not be empty", "messages")
        chat = [_prepare_message(m) for m in messages]
        variables = {
            **self._special_tokens,
            "documents": None,
            **template_kwargs,
            "messages": chat,
            "tools": tools,
            "add_generation_prompt": add_generation_prompt,
        }
        from pegainfer.core.text.chat_template import render

        return render(template, variables)

    def _select_template(self, tools: list[dict] | None) -> jinja2.Template:
        if not self._chat_templates:
            raise InvalidRequestError(
                "this model has no chat template (no chat_template in its tokenizer config and no "
                f"{CHAT_TEMPLATE_FILE}), so it cannot serve chat requests; use the completions API "
                "with a plain prompt instead",
                "messages",
            )
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if "default" in self._chat_templates:
            return self._chat_templates["default"]
        raise InvalidRequestError(
            "this model has several chat templates and none is named 'default': "
            f"{sorted(self._chat_templates)}",
            "messages",
        )


def _token_content(value: object) -> str | None:
    """A special-token entry is a string, or an AddedToken dict with the text under "content"."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def chat_template_sources(path: str | Path) -> dict[str, str]:
    """The Jinja source of a checkpoint directory's chat templates by name, found as
    `Tokenizer.from_dir` finds them, without loading the tokenizer."""
    path = Path(path)
    return _find_chat_templates(
        path, read_json_object(path / TOKENIZER_CONFIG_FILE, required=False)
    )


def _find_chat_templates(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    template_file = path / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        templates["default"] = template_file.read_text(encoding="utf-8")
    template_dir = path / CHAT_TEMPLATE_DIR
    if template_dir.is_dir():
        for file in sorted(template_dir.glob("*.jinja")):
            templates[file.name.removesuffix(".jinja")] = file.read_text(encoding="utf-8")
    if templates:
        return templates

    entry = config.get("chat_template")
    if isinstance(entry, str):
        return {"default": entry}
    if isinstance(entry, list):
        try:
            return {t["name"]: t["template"] for t in entry}
        except (TypeError, KeyError) as e:
            raise ConfigError(
                f"chat_template in {path / TOKENIZER_CONFIG_FILE} must be a string or a list of "
                '{"name": ..., "template": ...} objects'
            ) from e
    return {}


def _prepare_message(message: object) -> dict[str, Any]:
    """Normalize one message the way transformers does before rendering.

    Keys whose value is None are dropped (OpenAI clients send `"content": null` next to
    `tool_calls`, and templates test for missing keys, not for None), and reasoning given under any
    of its names is made visible under all of them.
    """
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"each message must be an object, got {message!r}", "messages")
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message
