"""Export a training checkpoint's model as one consolidated model.safetensors plus config.json.

python tools/export_checkpoint.py CHECKPOINT OUT [--dtype fp32|bf16]

CHECKPOINT is a DCP step directory (runs/<run>/checkpoints/step-0000100), or a run or checkpoints
directory, meaning the checkpoint its `latest` names. The checkpoint's files are checked against
its checksums first. OUT gets model.safetensors (every tensor merged from all ranks' shards),
a Hugging Face config.json of the model's family (transformers loads the directory as is) with
bos/eos/pad_token_id, a generation_config.json that stops at the chat template's end-of-turn
token and the end-of-text token (where tools/generate.py stops), hybrid2d_config.json (the run's
settings), and the run's tokenizer files. The token ids are those of the HF model the run
started from (checkpoint.init_from, while it is still there), else the checkpoint's tokenizer's
(hybrid2d/checkpoint/hf_tokens.py); the summary's last line says which.

Streaming: tensors are read from the DCP files and appended to the safetensors file one at a
time, so the process never holds more than one tensor (plus the output file's header). Large
models can be split into several files with --max-shard-size (HF's index format).
"""

from __future__ import annotations

import os
import shutil
import sys

from hybrid2d.cli import OneLineParser, positive_size

ONE_FILE = 2**62  # no size cap: a single model.safetensors


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="DCP step directory, or a run / checkpoints directory")
    p.add_argument("out", help="new directory to write")
    p.add_argument("--dtype", default="fp32", help="fp32 (default) or bf16")
    p.add_argument(
        "--max-shard-size",
        default="",
        help="split into files of at most this size (5GB = 5e9 bytes, 4GiB = 4 x 2^30, or bytes)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    from hybrid2d.checkpoint import layout, standalone
    from hybrid2d.checkpoint.hf_convert import convert_dcp_to_hf, parse_dtype, run_tool
    from hybrid2d.errors import ConfigError

    def work() -> str:
        dtype = parse_dtype(args.dtype, ("fp32", "bf16"))
        cap = (
            positive_size(args.max_shard_size, "--max-shard-size", bare_bytes=True)
            if args.max_shard_size
            else ONE_FILE
        )
        src = standalone.locate(args.checkpoint)
        if src.kind != "dcp":
            raise ConfigError(
                f"{args.checkpoint} is already a safetensors directory; pass a DCP checkpoint"
            )
        standalone.verify(src.path)
        standalone.model_config(src)  # a checkpoint without config.json fails here, clearly
        summary = convert_dcp_to_hf(
            str(src.path), args.out, cap, dtype, progress=not args.no_progress
        )
        shutil.copyfile(
            src.path / layout.CONFIG, os.path.join(args.out, standalone.HYBRID2D_CONFIG)
        )
        return summary.lines(f"exported {src.path} -> {args.out}")

    return run_tool(work)


if __name__ == "__main__":
    sys.exit(main())
