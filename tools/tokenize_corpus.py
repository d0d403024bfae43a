"""Tokenize a text corpus once, in parallel, into shards that training reads memory-mapped.

python tools/tokenize_corpus.py --data.path CORPUS --data.tokenizer TOKENIZER --out DIR
                                [--data.text_field text] [--workers N] [--shard-size 16MB]

CORPUS is what data.path takes for text: a .txt/.jsonl/.parquet file or a directory of them, a
Hugging Face `datasets` directory (save_to_disk), or hf:NAME[:CONFIG][@SPLIT][#REVISION] / hf:/DIR
read with datasets.load_dataset(streaming=True) (those need the datasets package). TOKENIZER
is a tokenizer.json or a Hugging Face model directory holding one. DIR gets the shards
(shard-NNNNNN.bin, raw token ids), each shard's document ends, the tokenizer and
token-index.json (written last). Train on it with --data.path DIR --data.tokenizer TOKENIZER
(or DIR/tokenizer.json): the run checks the tokenizer against the index, maps the shards and
tokenizes nothing; its batches are those it would see with --data.path CORPUS.

Each document is encoded as the trainer's inline path encodes it (BOS where the tokenizer's
post-processor adds one, EOS at its end). --workers processes (default: the cores) encode one
shard of about --shard-size characters each; memory stays bounded by the shard size and the
workers, whatever the corpus size. Killed, it resumes when run again with the same arguments:
shards already written are kept. Text only: instruction data keeps the trainer's own cache.
"""

from __future__ import annotations

import pathlib
import sys
import time

from hybrid2d.cli import OneLineParser, positive_size, run_and_exit
from hybrid2d.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--data.path", dest="path", required=True, help="the corpus (as data.path)")
    p.add_argument("--data.tokenizer", dest="tokenizer", required=True,
                   help="tokenizer.json or a Hugging Face model directory")  # fmt: skip
    p.add_argument("--data.text_field", dest="text_field", default="text",
                   help="the text's field in .jsonl / column in .parquet and datasets")  # fmt: skip
    p.add_argument("--out", required=True, help="directory for the shards and the index")
    p.add_argument("--workers", type=int, default=0, help="worker processes (0: the cores)")
    p.add_argument("--shard-size", default="16MB",
                   help="characters of text per shard, as a size (16MB: 16 million)")  # fmt: skip
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    from hybrid2d.config import DataConfig
    from hybrid2d.data.preprocess import default_workers, preprocess

    try:
        if args.workers < 0:
            raise ConfigError(f"--workers {args.workers} must be >= 0 (0: one per core)")
        shard_chars = positive_size(args.shard_size, "--shard-size")
        d = DataConfig(path=args.path, tokenizer=args.tokenizer, text_field=args.text_field,
                       format="text")  # fmt: skip
        workers = args.workers or default_workers()
        report = preprocess(d, pathlib.Path(args.out).expanduser(), workers, shard_chars,
                            Progress())  # fmt: skip
    except ConfigError as e:
        print(f"\nerror: {e}" if Progress.shown else f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if Progress.shown:
        print(file=sys.stderr)
    print(report.line())
    return 0


class Progress:
    """A line on stderr: shards done, tokens encoded and tokens/s; rewritten in place on a
    terminal, a new line every 10 s otherwise (a log file)."""

    shown = False

    def __init__(self):
        self.tty = sys.stderr.isatty()
        self.last = 0.0

    def __call__(self, shards: int, tokens: int, seconds: float) -> None:
        now = time.monotonic()
        if now - self.last < (0.5 if self.tty else 10.0):
            return
        self.last = now
        line = (f"{shards} shards, {tokens / 1e6:,.1f}M tokens encoded, "
                f"{tokens / max(seconds, 1e-9):,.0f} tokens/s")  # fmt: skip
        print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr,
              flush=True)  # fmt: skip
        Progress.shown = self.tty


if __name__ == "__main__":
    run_and_exit(main)
