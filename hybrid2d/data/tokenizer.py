"""The tokenizer: a user's tokenizer.json, or a byte-level BPE trained on the corpus and cached.

Byte-level BPE needs no unknown token and round-trips any text exactly, so the built-in corpus
trains a usable tokenizer of exactly the model's vocabulary size in seconds, with no download.
For instruction data the BPE learns from the samples as the model will see them (prompt +
completion, conversations rendered with chat.SCRATCH_TEMPLATE), has that template's turn markers
as special tokens, and its cache directory holds the template and a tokenizer_config.json
beside tokenizer.json: a tokenizer directory like a pretrained model's.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hybrid2d.config import DataConfig, JobConfig
from hybrid2d.data.cache import atomic_path, cache_key, must_build, read_cached
from hybrid2d.data.chat import SCRATCH_TEMPLATE, TURN_END, TURN_START, scratch_chat_files
from hybrid2d.data.corpus import corpus_documents, corpus_identity
from hybrid2d.errors import ConfigError
from hybrid2d.layout import RunLayout
from hybrid2d.paths import tokenizer_file

EOS_TOKEN = "<|endoftext|>"
# Document separators used by common tokenizer families (GPT-2/NeoX, Llama 1-2/Mistral,
# Llama 3, Gemma), in order of preference.
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<|end_of_text|>", "<eos>")


def load_or_train_tokenizer(
    cfg: DataConfig,
    vocab_size: int,
    cache_dir: pathlib.Path,
    build: bool = True,
    samples: Iterable[str] | None = None,
) -> Tokenizer:
    """cfg.tokenizer loaded, or a cached BPE of exactly vocab_size tokens trained on the corpus
    or, for instruction data, on `samples` (the rendered samples; read only when the BPE is
    trained); with build=False a missing cache entry is an error, not a job."""
    if cfg.tokenizer:
        tok = _load_user_tokenizer(cfg.tokenizer)
    else:
        folder = trained_tokenizer_dir(cfg, vocab_size, cache_dir, samples is not None)
        path = folder / "tokenizer.json"
        if must_build(path, build, cache_dir, f"trained tokenizer {path.name}"):
            if samples is None:
                tok = train_bpe(corpus_documents(cfg), vocab_size)
            else:
                tok = train_bpe(samples, vocab_size, (EOS_TOKEN, TURN_START, TURN_END))
                for name, text in scratch_chat_files(EOS_TOKEN).items():
                    with atomic_path(folder / name) as tmp:
                        tmp.write_text(text, encoding="utf-8")
            with atomic_path(path) as tmp:  # last: its presence means the directory is whole
                tok.save(str(tmp))
        # Loading what was saved (also right after training) makes every process hash and use
        # byte-identical tokenizers.
        tok = read_cached(path, lambda p: Tokenizer.from_file(str(p)))
    n = vocab_extent(tok)
    if n > vocab_size:
        raise ConfigError(
            f"data.tokenizer={cfg.tokenizer!r} has {n} tokens but model.vocab_size "
            f"is {vocab_size}; set model.vocab_size >= {n}"
        )
    return tok


def trained_tokenizer_dir(
    cfg: DataConfig, vocab_size: int, cache_dir: pathlib.Path, instruct: bool = False
) -> pathlib.Path:
    """The cache directory of the BPE trained on cfg's data (instruct: on its rendered
    instruction samples); a directory, so it can also be passed back as data.tokenizer."""
    if instruct:
        key = cache_key("bpe-chat-v1", corpus_identity(cfg), vocab_size, SCRATCH_TEMPLATE)
        return pathlib.Path(cache_dir) / "tokenizers" / f"bpe{vocab_size}-chat-{key}"
    key = cache_key("bpe-v1", corpus_identity(cfg), vocab_size, cfg.max_chars)
    return pathlib.Path(cache_dir) / "tokenizers" / f"bpe{vocab_size}-{key}"


def train_bpe(docs, vocab_size: int, special: tuple[str, ...] = (EOS_TOKEN,)) -> Tokenizer:
    """A byte-level BPE with exactly vocab_size tokens, the `special` tokens first."""
    if vocab_size < 256 + len(special):
        raise ConfigError(
            f"model.vocab_size={vocab_size} is too small for a byte-level BPE "
            f"(256 bytes + {' '.join(special)}); use >= {256 + len(special)}"
        )
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(text)) == text.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer)
    # A small corpus can run out of pairs to merge before reaching vocab_size; reserved tokens
    # fill the rest so the tokenizer and the model's embedding always agree on the size.
    short = vocab_size - tok.get_vocab_size()
    if short > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    return tok


def _load_user_tokenizer(setting: str) -> Tokenizer:
    path = tokenizer_file(setting)
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises plain Exception on bad files
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(
            f"data.tokenizer={setting!r}: {path} is not a tokenizers file ({first}); "
            "use a tokenizer.json saved by the tokenizers library"
        ) from None


def vocab_extent(tok: Tokenizer) -> int:
    """Rows an embedding needs for this tokenizer: its size, or the largest id + 1 if ids have
    gaps."""
    vocab = tok.get_vocab(with_added_tokens=True)
    return max(tok.get_vocab_size(with_added_tokens=True), max(vocab.values(), default=-1) + 1)


def eos_id(tok: Tokenizer) -> int:
    """The id of the end-of-document token placed between packed documents."""
    for name in EOS_CANDIDATES:
        i = tok.token_to_id(name)
        if i is not None:
            return i
    raise ConfigError(
        f"data.tokenizer has none of the end-of-text tokens {list(EOS_CANDIDATES)}; "
        "use a tokenizer that defines one, or '' to train a BPE"
    )


def leading_special_ids(tok: Tokenizer) -> list[int]:
    """The ids the tokenizer's post-processor puts before a text: Llama's and Mistral's BOS,
    which inference (tools/generate.py's prompt, transformers' tokenizer call) puts before a
    prompt; [] for tokenizers without one."""
    plain = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


@contextlib.contextmanager
def special_tokens_as_text(tok: Tokenizer):
    """Encode text that spells a special token ("<|endoftext|>" inside a document) as text: it
    must not become a real document boundary. The caller's setting is restored afterwards."""
    before = tok.encode_special_tokens
    tok.encode_special_tokens = True
    try:
        yield
    finally:
        tok.encode_special_tokens = before


def tokenizer_hash(tok: Tokenizer) -> str:
    """Identity of a tokenizer for cache keys: a hash of its full serialized form."""
    return cache_key(tok.to_str())


def describe_tokenizer(cfg: JobConfig, layout: RunLayout) -> str:
    """Which tokenizer a run uses, for its start line: the file, and whether it is the one
    stored with checkpoint.init_from, or the BPE trained on the corpus."""
    d = cfg.data
    if not layout.tokenizer:
        corpus = repr(d.path) if d.path else "the built-in corpus"
        return f"byte-level BPE of {layout.model.vocab_size} tokens trained on {corpus}"
    path = pathlib.Path(layout.tokenizer).expanduser()
    shown = path / "tokenizer.json" if path.is_dir() else path
    init = cfg.checkpoint.init_from.partition(":")[2]
    if init and path.resolve() == pathlib.Path(init).expanduser().resolve():
        return f"{shown} (stored with checkpoint.init_from)"
    return str(shown)
