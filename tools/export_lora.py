"""Export a LoRA run's adapters in PEFT's format: adapter_model.safetensors + adapter_config.json.

python tools/export_lora.py CHECKPOINT OUT [--dtype fp32|bf16]

CHECKPOINT is a LoRA run's DCP step directory, or its run / checkpoints directory (meaning the
checkpoint its `latest` names); its files are checked against its checksums first. OUT gets the
adapters under PEFT's names (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`)
and PEFT's LoraConfig (rank, alpha, dropout, target modules, and the HF directory the run
started from as base_model_name_or_path), so that

    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(BASE), OUT)

gives the trained model. `--merged DIR` also writes the base HF directory with the adapters
merged into its weights (W + alpha / rank B A): a plain model for transformers, no PEFT needed.
"""

from __future__ import annotations

import sys
from pathlib import Path

from hybrid2d.cli import OneLineParser


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="DCP step directory, or a run / checkpoints directory")
    p.add_argument("out", help="directory to write (created if missing)")
    p.add_argument("--dtype", default="fp32", help="fp32 (default) or bf16")
    p.add_argument("--merged", default="", help="also write the merged full HF model here")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)

    from hybrid2d.checkpoint import standalone
    from hybrid2d.checkpoint.adapters import export_merged, export_peft
    from hybrid2d.checkpoint.hf_convert import parse_dtype, run_tool
    from hybrid2d.checkpoint.reader import read_metadata
    from hybrid2d.errors import ConfigError

    def work() -> str:
        dtype = parse_dtype(args.dtype, ("fp32", "bf16"))
        src = standalone.locate(args.checkpoint)
        if src.kind != "dcp":
            raise ConfigError(
                f"{args.checkpoint} is a safetensors directory; pass a LoRA run's DCP checkpoint"
            )
        standalone.verify(src.path)
        meta = read_metadata(src.path)
        cfg, n = export_peft(src.path, meta, Path(args.out), dtype)
        lines = [
            f"exported {n} adapter tensors (rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g}) of "
            f"{src.path} -> {args.out} (PEFT: adapter_model.safetensors, adapter_config.json)"
        ]
        if args.merged:
            merged = export_merged(src.path, meta, Path(args.merged))
            lines.append(f"merged {merged} adapted weights into {args.merged} (a HF model)")
        return "\n".join(lines)

    return run_tool(work)


if __name__ == "__main__":
    sys.exit(main())
