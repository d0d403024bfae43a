"""Text documents from Hugging Face `datasets`: a directory written by save_to_disk, or a dataset
read with load_dataset(streaming=True) (an hf: data path: a Hub dataset or a local directory of
data files).

`datasets` is the reader of its own formats (Arrow shards with a state.json, the Hub's data files
and configurations), so it is used rather than reimplemented; it is optional, imported only
here, and hybrid2d/paths.py says in one line that it is missing before anything runs. Opening a
source (load_from_disk, or load_dataset resolving a Hub dataset) happens when the documents are
asked for, so a Hub that cannot be reached, a configuration or split that does not exist, or a
missing text column is one ConfigError line naming the setting before a document is read.
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

from hybrid2d.config import DataConfig
from hybrid2d.errors import ConfigError
from hybrid2d.paths import HFSource

BATCH_ROWS = 1024  # rows per batch read: Python lists of one column, small beside a window
_TEXT_TYPES = ("string", "large_string", "string_view")


def _datasets(value: str, setting: str):
    try:
        import datasets
    except ImportError:  # paths.data_source says it first; this covers callers that skip it
        raise ConfigError(
            f"{setting}={value!r} needs the datasets package: pip install datasets "
            "(or pip install 'hybrid2d[hf]')"
        ) from None
    return datasets


def saved_documents(path: pathlib.Path, cfg: DataConfig, setting: str) -> Iterator[str]:
    """The text column of a save_to_disk directory (a Dataset, or a DatasetDict of one split),
    rows in order; empty and null texts are skipped, as in a .parquet file."""
    datasets = _datasets(cfg.path, setting)
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):  # paths.py refuses several splits
        (loaded,) = loaded.values()
    _check_column(loaded.features, cfg, setting, str(path))
    return _texts(loaded.select_columns([cfg.text_field]), cfg, setting)


def streamed_documents(spec: HFSource, cfg: DataConfig, setting: str) -> Iterator[str]:
    """The text column of load_dataset(..., streaming=True): read as it is iterated, nothing
    downloaded first or cached; a Hub that cannot be reached is one line naming `setting`."""
    datasets = _datasets(cfg.path, setting)
    args = {"split": spec.split, "streaming": True}
    if spec.config:
        args["name"] = spec.config
    if spec.revision:
        args["revision"] = spec.revision
    try:
        stream = datasets.load_dataset(spec.name, **args)
    except ConnectionError as e:
        raise ConfigError(
            f"{setting}={cfg.path!r}: the Hugging Face Hub cannot be reached ({_first_line(e)}); "
            "connect to it, unset HF_DATASETS_OFFLINE/HF_HUB_OFFLINE, or download the data "
            f"files and set {setting} to hf:/DIR of them"
        ) from None
    except Exception as e:  # the dataset's name, configuration or split, or its files
        raise ConfigError(
            f"{setting}={cfg.path!r}: datasets.load_dataset({spec.name!r}, "
            f"{', '.join(f'{k}={v!r}' for k, v in args.items())}) failed: "
            f"{type(e).__name__}: {_first_line(e)}"
        ) from None
    _check_column(stream.features, cfg, setting, cfg.path)
    return _texts(stream, cfg, setting)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _check_column(features, cfg: DataConfig, setting: str, where: str) -> None:
    """The text column exists and holds strings, where the dataset's features are known (a
    stream of raw files may learn them only from its first rows: _texts checks those)."""
    if features is None:
        return
    if cfg.text_field not in features:
        raise ConfigError(
            f"data.text_field={cfg.text_field!r} is not a column of {where} (columns: "
            f"{list(features)}); set data.text_field to the text column"
        )
    kind = features[cfg.text_field]
    if getattr(kind, "dtype", None) not in _TEXT_TYPES:
        raise ConfigError(
            f"data.text_field={cfg.text_field!r} in {where} is a {kind} column, not text; "
            "set data.text_field to a string column"
        )


def _texts(dataset, cfg: DataConfig, setting: str) -> Iterator[str]:
    field = cfg.text_field
    for batch in dataset.iter(batch_size=BATCH_ROWS):
        if field not in batch:
            raise ConfigError(
                f"data.text_field={field!r} is not a column of {cfg.path} (columns: "
                f"{list(batch)}); set data.text_field to the text column"
            )
        for text in batch[field]:
            if text is None or text == "":
                continue
            if not isinstance(text, str):
                raise ConfigError(
                    f"data.text_field={field!r} in {setting}={cfg.path!r} holds a "
                    f"{type(text).__name__}, not a string; set data.text_field to a text column"
                )
            yield text
