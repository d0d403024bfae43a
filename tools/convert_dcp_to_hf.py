"""Export the model of a DCP checkpoint as a Hugging Face directory, streaming.

python tools/convert_dcp_to_hf.py SRC DST [--max-shard-size 5GB] [--dtype bf16]

SRC is a directory from tools/convert_hf_to_dcp.py, a training checkpoint's step directory, or
a run or checkpoints directory, meaning the checkpoint its `latest` names, as for
tools/generate.py and `init_from dcp:` (only the "model" entry is read). DST gets size-capped
model-*.safetensors shards with model.safetensors.index.json (or one model.safetensors), a
config.json that transformers.AutoModelForCausalLM.from_pretrained loads, and SRC's tokenizer
files. A converted SRC's config.json and generation_config.json are the original's; a training
checkpoint's get the token ids and stops that tools/export_checkpoint.py writes
(hybrid2d/checkpoint/hf_tokens.py).
"""

from __future__ import annotations

import sys

from hybrid2d.cli import OneLineParser, positive_size


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="DCP checkpoint directory, or a run / checkpoints directory")
    parser.add_argument("dst", help="new directory for the Hugging Face checkpoint")
    parser.add_argument(
        "--max-shard-size",
        default="5GB",
        help="cap per safetensors file: 5GB (5e9 bytes), 4GiB (4 x 2^30), 500MB, or bytes",
    )
    parser.add_argument("--dtype", default=None, help="cast floating tensors: fp32, bf16, fp16")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    from hybrid2d.checkpoint import standalone
    from hybrid2d.checkpoint.hf_convert import convert_dcp_to_hf, parse_dtype, run_tool

    def work() -> str:
        cap = positive_size(args.max_shard_size, "--max-shard-size", bare_bytes=True)
        dtype = parse_dtype(args.dtype)
        src = standalone.locate(args.src)  # an HF directory: read_metadata says it is not DCP
        summary = convert_dcp_to_hf(
            str(src.path), args.dst, cap, dtype, progress=not args.no_progress
        )
        return summary.lines(f"exported {src.path} -> {args.dst} (Hugging Face safetensors)")

    return run_tool(work)


if __name__ == "__main__":
    sys.exit(main())
