"""Chat templates: the Jinja template stored with a tokenizer, rendered as transformers does.

The template comes from the tokenizer's directory: `chat_template.jinja` (transformers 5 saves
it there) or the `chat_template` entry of `tokenizer_config.json` (a string, or a list of named
templates, of which "default" is used). It is rendered the way transformers'
`apply_chat_template` renders it: jinja2's ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, the loopcontrols extension, a `tojson` that does not escape HTML,
`raise_exception`, `strftime_now`, and the tokenizer's special tokens (bos_token, eos_token, ...)
as variables. tests/test_finetune_data.py checks the text equals transformers' on the same files.
"""

from __future__ import annotations

import datetime
import json
import pathlib

from hybrid2d.errors import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_KEYS = tuple(f"{n}_token" for n in ("bos", "eos", "unk", "sep", "pad", "cls", "mask"))


class TemplateRenderError(ValueError):
    """The template raised while rendering (raise_exception, a Jinja error); the message says
    what it said."""


def tokenizer_dir(setting: str) -> pathlib.Path | None:
    """The directory holding a data.tokenizer setting's files (it, or its tokenizer.json's)."""
    if not setting:
        return None
    path = pathlib.Path(setting).expanduser()
    return path if path.is_dir() else path.parent


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # an AddedToken as transformers serialises it
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens."""

    def __init__(self, source: str, special: dict[str, str] | None = None, where: str = ""):
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source
        self.where = where
        self.special = dict(special or {})

        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(
                x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                sort_keys=sort_keys,
            )  # fmt: skip

        def strftime_now(fmt):
            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[_generation_extension(), jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.exceptions.TemplateError as e:
            raise ConfigError(f"chat template {where} does not compile ({e})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as text; TemplateRenderError if the template refuses it."""
        import jinja2

        try:
            return self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special,
            )
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, KeyError) as e:
            raise TemplateRenderError(f"{type(e).__name__}: {e}") from None


def _generation_extension():
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask tag) renders its
    body unchanged, so templates that use it compile."""
    import jinja2
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(
                lineno
            )

        def _body(self, caller):
            return caller()

    return Generation


def load_chat_template(setting: str) -> ChatTemplate | None:
    """The chat template stored with data.tokenizer=setting, or None if it has none."""
    d = tokenizer_dir(setting)
    if d is None:
        return None
    config = {}
    cfg_path = d / TOKENIZER_CONFIG
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ConfigError(f"data.tokenizer={setting!r}: {cfg_path} is not JSON ({e})") from None
        if not isinstance(config, dict):
            raise ConfigError(f"data.tokenizer={setting!r}: {cfg_path} is not a JSON object")
    special = {}
    for key in SPECIAL_KEYS:
        text = _token_text(config.get(key))
        if text is not None:
            special[key] = text
    jinja = d / TEMPLATE_FILE
    if jinja.is_file():
        try:
            return ChatTemplate(jinja.read_text(encoding="utf-8"), special, str(jinja))
        except UnicodeDecodeError as e:
            raise ConfigError(f"chat template {jinja} is not UTF-8 text ({e})") from None
    source = config.get("chat_template")
    if isinstance(source, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if isinstance(source, str) and source:
        return ChatTemplate(source, special, f"{cfg_path} chat_template")
    return None


# The chat format of a tokenizer trained here (no data.tokenizer) on instruction data: ChatML,
# whose turn markers become special tokens of the BPE. It needs no BOS, system prompt or
# per-model text, so any conversation renders, and transformers, vLLM and llama.cpp know it.
TURN_START, TURN_END = "<|im_start|>", "<|im_end|>"
SCRATCH_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def scratch_chat_files(end_of_text: str) -> dict[str, str]:
    """name -> text of the files beside a tokenizer trained here for instruction data: the
    template, and a tokenizer_config.json naming the end of a turn as eos_token (where
    generation stops, as for Qwen's ChatML models) and `end_of_text` as the padding."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": TURN_END,
        "pad_token": end_of_text,
    }
    return {TEMPLATE_FILE: SCRATCH_TEMPLATE, TOKENIZER_CONFIG: json.dumps(config, indent=2) + "\n"}


# Files next to tokenizer.json that carry the chat template and the special tokens' roles;
# checkpoints keep them so generate --chat and exports work from a fine-tuned run.
SIDE_FILES = (TOKENIZER_CONFIG, TEMPLATE_FILE, "special_tokens_map.json", "chat_template.json")


def tokenizer_side_files(setting: str) -> dict[str, str]:
    """name -> text of the SIDE_FILES stored with data.tokenizer=setting."""
    d = tokenizer_dir(setting)
    if d is None:
        return {}
    return {n: (d / n).read_text(encoding="utf-8") for n in SIDE_FILES if (d / n).is_file()}


def end_of_turn_ids(setting: str, tok) -> set[int]:
    """Token ids that end an assistant turn: tokenizer_config.json's eos_token, if any."""
    d = tokenizer_dir(setting)
    if d is None or not (d / TOKENIZER_CONFIG).is_file():
        return set()
    try:
        config = json.loads((d / TOKENIZER_CONFIG).read_text(encoding="utf-8"))
    except ValueError:
        return set()
    text = _token_text(config.get("eos_token"))
    i = tok.token_to_id(text) if text else None
    return {i} if i is not None else set()
