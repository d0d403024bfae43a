"""Preprocessing a corpus and starting a run on it: tokens/s and peak RSS of
tools/tokenize_corpus.py at two corpus sizes with 1 and 2 workers, and the time from launch to a
run's first step on a preprocessed corpus of a few hundred MB against the built-in corpus.

    python tools/bench_data.py --sizes 16MB,64MB --large 300MB --shard-size 4MB \
        --out docs/benchmarks-data.json

The corpora are the Python standard library's sources (about 12 MB, on every machine), repeated
in a shuffled order per copy as JSONL until each reaches its size, written to a temporary folder
that is deleted afterwards (with the shards). Each size runs --repeats times with 1 and 2
workers, alternating, and the fastest of each is kept; tokens per worker CPU second is the
per-core rate, which a loaded machine does not change as much as the wall time. The tokenizer
is a byte-level BPE of the recipe's vocabulary trained on 2 MB of them. The first-step runs
are one process (recipes/llama.py, llama-debug, one step, no checkpoint); their time is from
launch to the `step 1/1` line. The built-in corpus runs twice on one cache: cold (it trains its
BPE and tokenizes) and warm.
"""

from __future__ import annotations

import json
import os
import pathlib
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

from hybrid2d.cli import OneLineParser, positive_size

REPO = pathlib.Path(__file__).resolve().parent.parent
SUMMARY = re.compile(
    r"into ([\d,]+) tokens .* in ([\d.]+) s: ([\d,]+) tokens/s with \d+ workers, ([\d,]+) per "
    r"worker CPU second \(CPU: main (\d+) s, workers (\d+) s\); peak RSS main (\d+) MiB, "
    r"worker (\d+) MiB"
)


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16MB,64MB", help="two corpus sizes for the tool")
    p.add_argument("--large", default="300MB", help="the first-step run's corpus (0: no such runs)")
    p.add_argument("--shard-size", default="4MB", help="the tool's --shard-size")
    p.add_argument("--repeats", type=int, default=2, help="runs of each size and worker count")
    p.add_argument("--out", default="", help="also write the figures to this JSON file")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    sizes = [positive_size(s, "--sizes") for s in args.sizes.split(",")]
    large = positive_size(args.large, "--large") if args.large != "0" else 0
    shard = args.shard_size

    from hybrid2d.data.corpus import default_corpus_files
    from hybrid2d.data.tokenizer import train_bpe

    texts = [f.read_text(encoding="utf-8", errors="replace") for f in default_corpus_files()]
    figures: dict = {"tool": [], "first_step": []}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        root = pathlib.Path(tmp)
        sample = texts[: _count_to(texts, 2_000_000)]
        tok = root / "tokenizer.json"
        train_bpe(sample, 4096).save(str(tok))  # llama-debug's vocabulary
        for size in sizes:
            corpus = _corpus(root / f"corpus-{size}.jsonl", texts, size)
            for _ in range(args.repeats):  # 1, 2, 1, 2: a shared machine's drift hits both
                for workers in (1, 2):
                    row = _tokenize(corpus, tok, root / "out", workers, size, shard)
                    figures["tool"].append(row)
                    shutil.rmtree(root / "out")
            corpus.unlink()
        if args.repeats > 1:
            figures["tool"] = _fastest(figures["tool"])
        if large:
            corpus = _corpus(root / "large.jsonl", texts, large)
            figures["tool"].append(_tokenize(corpus, tok, root / "large", 2, large, shard))
            corpus.unlink()  # the run reads the shards only
            cache = root / "cache"
            preprocessed = ["--data.path", str(root / "large"), "--data.tokenizer", str(tok)]
            runs = {"built-in, cold cache": [], "built-in, warm cache": [],
                    f"preprocessed {large / 1e6:.0f} MB": preprocessed}  # fmt: skip
            for name, data in runs.items():
                figures["first_step"].append(_first_step(name, data, cache, root / "run"))
                shutil.rmtree(root / "run", ignore_errors=True)
    text = json.dumps(figures, indent=1)
    print(text)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    return 0


def _fastest(rows: list[dict]) -> list[dict]:
    """The fastest run of each (size, workers), with how many it is the best of."""
    best: dict = {}
    for row in rows:
        key = (row["corpus_mb"], row["workers"])
        if key not in best or row["seconds"] < best[key]["seconds"]:
            best[key] = row | {
                "runs": sum(1 for r in rows if (r["corpus_mb"], r["workers"]) == key)
            }
    return list(best.values())


def _count_to(texts: list[str], chars: int) -> int:
    total = 0
    for i, t in enumerate(texts):
        total += len(t)
        if total >= chars:
            return i + 1
    return len(texts)


def _corpus(path: pathlib.Path, texts: list[str], size: int) -> pathlib.Path:
    """JSONL of the texts, each copy in its own shuffled order, until `size` bytes."""
    rng = random.Random(0)
    written = 0
    with open(path, "w") as f:
        while written < size:
            order = list(range(len(texts)))
            rng.shuffle(order)
            for i in order:
                line = json.dumps({"text": texts[i]}) + "\n"
                f.write(line)
                written += len(line)
                if written >= size:
                    break
    return path


def _tokenize(corpus, tok, out, workers: int, size: int, shard: str) -> dict:
    cmd = [sys.executable, str(REPO / "tools" / "tokenize_corpus.py"), "--data.path",
           str(corpus), "--data.tokenizer", str(tok), "--out", str(out), "--workers",
           str(workers), "--shard-size", shard]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
    m = SUMMARY.search(proc.stdout)
    tokens, seconds, rate, per_core, main_cpu, workers_cpu, main_rss, worker_rss = m.groups()
    row = {
        "corpus_mb": round(size / 1e6),
        "workers": workers,
        "tokens": int(tokens.replace(",", "")),
        "seconds": float(seconds),
        "tokens_per_s": int(rate.replace(",", "")),
        "tokens_per_worker_cpu_s": int(per_core.replace(",", "")),
        "cpu_s_main": int(main_cpu),
        "cpu_s_workers": int(workers_cpu),
        "load_average_1min": round(os.getloadavg()[0], 1),
        "peak_rss_main_mib": int(main_rss),
        "peak_rss_worker_mib": int(worker_rss),
    }
    print(row, file=sys.stderr, flush=True)
    return row


def _first_step(name: str, data: list[str], cache, run_dir) -> dict:
    cmd = [sys.executable, str(REPO / "recipes" / "llama.py"), "--train.steps", "1",
           "--checkpoint.save_final", "false", "--metrics.run_dir", str(run_dir),
           "--data.cache_dir", str(cache), *data]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)  # fmt: skip
    seconds = None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if seconds is None and line.startswith("step 1/1"):
            seconds = time.perf_counter() - start
    if proc.wait() != 0 or seconds is None:
        raise SystemExit(f"{name}: the run failed:\n{''.join(lines[-20:])}")
    row = {"data": name, "seconds_to_first_step": round(seconds, 1)}
    print(row, file=sys.stderr, flush=True)
    return row


if __name__ == "__main__":
    sys.exit(main())
