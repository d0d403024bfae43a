"""Where training text comes from: the built-in corpus or the user's files, as plain documents.

The built-in corpus is the Python standard library's own sources, because they exist on every
machine that can run this trainer: a default run never downloads anything. A user corpus is a
file or a directory of .txt / .jsonl / .parquet files, a Hugging Face datasets directory
(save_to_disk), or an hf: path read by datasets.load_dataset(streaming=True) (hf_datasets.py
reads those two). Bad input becomes one ConfigError line naming the setting, raised when
`corpus_documents` is called, before any expensive work; a bad line (not JSON, not UTF-8, no
text field, instruction data among text) names its file and line.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import sys
import sysconfig
from collections.abc import Iterator

from hybrid2d.config import DataConfig
from hybrid2d.data.hf_datasets import saved_documents, streamed_documents
from hybrid2d.errors import ConfigError
from hybrid2d.paths import (
    DATA_HINT,
    HF_PREFIX,
    SUFFIXES,
    data_source,
    hf_source,
    saved_dataset,
)

# Directory names under the stdlib that hold tests, demos or third-party code rather than the
# library itself (test data is full of deliberately odd text; site-packages varies by machine).
_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "turtledemo"}
)


def default_corpus_files() -> list[pathlib.Path]:
    """The stdlib's .py files minus test and third-party dirs, sorted by relative path.

    Sorting by the relative path (not by os.walk order) makes the corpus, and therefore every
    cache key and data order derived from it, identical across machines with the same Python.
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py") and not name.startswith("test_"):
                files.append(pathlib.Path(dirpath, name))
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def source_files(cfg: DataConfig, setting: str = "data.path") -> list[pathlib.Path]:
    """The data files behind cfg.path, or a ConfigError (naming `setting`, the option that gave
    cfg.path) saying why there are none. A Hub dataset (hf:NAME) has none here; a datasets
    directory's are its Arrow shards, an hf:/DIR's every file load_dataset may read."""
    if not cfg.path:
        return default_corpus_files()
    path = data_source(cfg.path, setting)
    if path is None:
        return []
    if path.is_file():
        return [path]
    if saved_dataset(path):
        return sorted(path.rglob("*.arrow"), key=lambda p: p.relative_to(path).as_posix())
    if is_hf_dataset(cfg.path):
        return sorted(
            (p for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")),
            key=lambda p: p.relative_to(path).as_posix(),
        )
    # Other files in a data directory (README.md, .gitattributes, ...) are not documents.
    files = sorted(
        (
            p
            for p in path.rglob("*")
            if p.is_file() and p.suffix in SUFFIXES and not p.name.startswith(".")
        ),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise ConfigError(
            f"{setting}={cfg.path!r} is a directory without any {'/'.join(SUFFIXES)} files; "
            f"{DATA_HINT}"
        )
    return files


def is_hf_dataset(path: str) -> bool:
    """True for data read through the datasets package: an hf: path or a save_to_disk
    directory. Such data is text, by its column data.text_field."""
    if not path:  # the built-in corpus (pathlib would read "" as the working directory)
        return False
    return path.startswith(HF_PREFIX) or saved_dataset(pathlib.Path(path).expanduser())


def source_name(cfg: DataConfig) -> str:
    """cfg.path as it names the corpus wherever it is run from: a file or directory resolved,
    an hf: path by its dataset, configuration, split and revision."""
    if cfg.path.startswith(HF_PREFIX):
        return hf_source(cfg.path).identity()
    return str(pathlib.Path(cfg.path).expanduser().resolve())


def corpus_identity(cfg: DataConfig) -> str:
    """A short hash that changes whenever the documents could change; the base of cache keys.

    Built from the files' names, sizes and modification times (cheap: no file is read) plus the
    settings that select text from them, so a cached tokenizer or token array is reused only for
    the same corpus. A Hub dataset (hf:NAME) has no files here: its name, configuration, split
    and revision are its identity, so without a pinned #REVISION a dataset changed on the Hub
    keeps its cache entries.
    """
    h = hashlib.sha256()
    if cfg.path:
        h.update(f"path={source_name(cfg)}\0field={cfg.text_field}\0".encode())
    else:
        h.update(f"stdlib={sys.version}\0".encode())
    for p in source_files(cfg):
        st = p.stat()
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update(f"max_chars={cfg.max_chars if not cfg.path else 0}\0".encode())
    return h.hexdigest()[:16]


def corpus_documents(cfg: DataConfig, setting: str = "data.path") -> Iterator[str]:
    """Every document of the corpus, in a fixed order.

    Source errors (missing path, unsupported suffix, empty directory) are raised by this call
    itself; errors found while reading (bad jsonl line, no documents at all) by the iteration.
    Errors name `setting`, the option cfg.path came from (data.val_path for validation data).
    `cfg.max_chars` limits only the built-in corpus: a user's own data is never cut silently.
    """
    files = source_files(cfg, setting)
    if not cfg.path:
        return _stdlib_documents(files, cfg.max_chars)
    if cfg.path.startswith(HF_PREFIX):
        docs = streamed_documents(hf_source(cfg.path, setting), cfg, setting)
        return _nonempty(docs, cfg, setting)
    path = pathlib.Path(cfg.path).expanduser()
    if saved_dataset(path):
        return _nonempty(saved_documents(path, cfg, setting), cfg, setting)
    return _user_documents(files, cfg, setting)


def _nonempty(docs: Iterator[str], cfg: DataConfig, setting: str) -> Iterator[str]:
    """docs, and at their end one line if there were none (a dataset of empty texts)."""
    count = 0
    for doc in docs:
        count += 1
        yield doc
    if count == 0:
        raise _no_documents(cfg, setting)


def _stdlib_documents(files: list[pathlib.Path], max_chars: int) -> Iterator[str]:
    left = max_chars if max_chars > 0 else None
    for p in files:
        text = p.read_text(encoding="utf-8", errors="replace")
        if left is not None:
            text = text[:left]
            left -= len(text)
        if text:
            yield text
        if left == 0:
            return


def not_utf8(line: str) -> str | None:
    """None if `line` (read with errors="surrogateescape") was valid UTF-8; else its first bad
    byte and where: "byte 0xff at offset 362 of the line"."""
    try:
        line.encode("utf-8")
        return None
    except UnicodeEncodeError as e:  # surrogateescape turned each bad byte into U+DC80..U+DCFF
        offset = len(line[: e.start].encode("utf-8", "surrogateescape"))
        return f"byte 0x{ord(line[e.start]) - 0xDC00:02x} at offset {offset} of the line"


def _user_documents(files: list[pathlib.Path], cfg: DataConfig, setting: str) -> Iterator[str]:
    count = 0
    text_seen: list[str] = []  # where the first text document is, for the mixed-format error
    for p in files:
        reader = {".txt": _read_txt, ".jsonl": _read_jsonl, ".parquet": _read_parquet}[p.suffix]
        for doc in reader(p, cfg, setting, text_seen):
            if doc:
                count += 1
                yield doc
    if count == 0:
        raise _no_documents(cfg, setting)


def _no_documents(cfg: DataConfig, setting: str) -> ConfigError:
    return ConfigError(
        f"{setting}={cfg.path!r} holds no non-empty documents; point it to "
        f"files with text (field data.text_field={cfg.text_field!r} for "
        ".jsonl/.parquet and datasets)"
    )


def _read_txt(p: pathlib.Path, cfg: DataConfig, setting: str, text_seen: list) -> Iterator[str]:
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        with open(p, encoding="utf-8", errors="surrogateescape") as f:
            lineno, bad = next((n, b) for n, line in enumerate(f, 1) if (b := not_utf8(line)))
        raise ConfigError(
            f"{setting}={cfg.path!r}: {p}:{lineno} is not UTF-8 text ({bad}); convert it to UTF-8"
        ) from None
    if text and not text_seen:
        text_seen.append(str(p))
    yield text


INSTRUCTION_KEYS = frozenset({"messages", "prompt", "completion"})


def _read_jsonl(p: pathlib.Path, cfg: DataConfig, setting: str, text_seen: list) -> Iterator[str]:
    field = cfg.text_field
    with open(p, encoding="utf-8", errors="surrogateescape") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if bad := not_utf8(line):
                raise ConfigError(
                    f"{setting}={cfg.path!r}: {p}:{lineno} is not UTF-8 text ({bad}); "
                    "convert it to UTF-8"
                )
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"{setting}={cfg.path!r}: {p}:{lineno} is not valid JSON "
                    f"({e.msg}); write one JSON object per line"
                ) from None
            instruction = isinstance(record, dict) and sorted(INSTRUCTION_KEYS & record.keys())
            if instruction and field not in record:
                raise _instruction_among_text(p, lineno, instruction, cfg, setting, text_seen)
            if not isinstance(record, dict) or field not in record:
                keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                raise ConfigError(
                    f"data.text_field={field!r} is missing from {p}:{lineno} "
                    f"(it has {keys}); set data.text_field to the text's key"
                )
            text = record[field]
            if not isinstance(text, str):
                raise ConfigError(
                    f"data.text_field={field!r} in {p}:{lineno} is a "
                    f"{type(text).__name__}, not a string; point data.text_field "
                    "to a text field"
                )
            if not text_seen:
                text_seen.append(f"{p}:{lineno}")
            yield text


def _instruction_among_text(
    p: pathlib.Path, lineno: int, keys: list, cfg: DataConfig, setting: str, text_seen: list
) -> ConfigError:
    """The error for an instruction line (prompt/completion or messages) read as text."""
    what = f"{p}:{lineno} is instruction data ({'/'.join(keys)})"
    if text_seen:
        chosen = "auto chose text by the first line" if cfg.format == "auto" else cfg.format
        return ConfigError(
            f"{setting}={cfg.path!r} mixes formats: {text_seen[0]} is text "
            f"(data.text_field={cfg.text_field!r}), {what}; a run reads one format "
            f"(data.format={chosen}): put text and instruction lines in separate files and "
            f"point {setting} at one kind"
        )
    read = f"data.format={cfg.format} reads it as text"
    if cfg.format == "text":
        fix = "use data.format auto or instruct"
    elif cfg.format == "instruct":  # a caller read instruction data as a text corpus
        read = "it was read as a text corpus although data.format=instruct"
        fix = "instruction data is read by hybrid2d.data.instruct (build_run_data), not as text"
    else:  # auto, where a file that is not .jsonl, or a first file of text, made it text
        fix = (
            f"data.format=auto reads {setting} as instruction data only when all its files are "
            f".jsonl and the first is instruction data; point {setting} at one kind"
        )
    return ConfigError(
        f"{setting}={cfg.path!r}: {what} but {read} "
        f"(field data.text_field={cfg.text_field!r}); {fix}"
    )


def _read_parquet(p: pathlib.Path, cfg: DataConfig, setting: str, text_seen: list) -> Iterator[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"{setting}={cfg.path!r} holds .parquet files, which need pyarrow; "
            "pip install pyarrow, or use .txt/.jsonl"
        ) from None
    pf = pq.ParquetFile(p)
    names = pf.schema_arrow.names
    if cfg.text_field not in names:
        raise ConfigError(
            f"data.text_field={cfg.text_field!r} is not a column of {p} (columns: "
            f"{names}); set data.text_field to the text column"
        )
    kind = pf.schema_arrow.field(cfg.text_field).type
    is_view = getattr(pa.types, "is_string_view", lambda _: False)  # pyarrow >= 16
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind)):
        raise ConfigError(
            f"data.text_field={cfg.text_field!r} in {p} is a {kind} column, not "
            "text; set data.text_field to a string column"
        )
    # Batches keep memory flat for big files; nulls are skipped like empty documents.
    for batch in pf.iter_batches(columns=[cfg.text_field], batch_size=4096):
        for text in batch.column(0).to_pylist():
            if text is not None:
                if text and not text_seen:
                    text_seen.append(str(p))
                yield text
