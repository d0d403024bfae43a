"""Convert a Hugging Face directory (safetensors) of a supported family into a DCP checkpoint,
streaming.

python tools/convert_hf_to_dcp.py SRC DST [--dtype bf16]

DST gets the DCP files ({"model": {<HF names>: tensors}}), config.json (a hybrid2d JobConfig
whose model section comes from SRC/config.json), hf_config.json (SRC/config.json verbatim) and
SRC's tokenizer files. Train from it with `--checkpoint.init_from dcp:DST`.
"""

from __future__ import annotations

import sys

from hybrid2d.cli import OneLineParser


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="Hugging Face model directory")
    parser.add_argument("dst", help="new directory for the DCP checkpoint")
    parser.add_argument("--dtype", default=None, help="cast floating tensors: fp32, bf16, fp16")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    from hybrid2d.checkpoint.hf_convert import convert_hf_to_dcp, parse_dtype, run_tool

    def work() -> str:
        dtype = parse_dtype(args.dtype)
        summary = convert_hf_to_dcp(args.src, args.dst, dtype, progress=not args.no_progress)
        return summary.lines(f"converted {args.src} -> {args.dst} (DCP)")

    return run_tool(work)


if __name__ == "__main__":
    sys.exit(main())
