"""Export a built-in model and compare engines on this machine's CPU, interleaved in one process.

    .venv/bin/python -m scripts.bench_cpu --model transformer --size small --engines eager,torch,compile \
        --batch-sizes 1,8,32 --seconds 2

Writes ``<out>/<stamp>-<model>-<size>.json`` and ``.png`` (default out: benchmarks/results) and
prints the table. Pass ``--artifact DIR`` to bench an existing export instead of exporting.
"""

from __future__ import annotations

import argparse
import datetime as dt
import logging
import tempfile
from pathlib import Path

import torch
from rich.console import Console

from tk.bench import measure, render_table, save_json, save_plot
from tk.export import ExportOptions, export
from tk.models import build_model
from tk.runtime import load

FORMAT_OF = {"torch": "torch", "onnx": "onnx", "aoti": "aoti", "trt": "trt"}  # engines that need an export format


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="transformer", help="registry name (default transformer)")
    parser.add_argument("--size", default="small", help="model size (default small)")
    parser.add_argument("--artifact", type=Path, help="an existing artifact directory; skips the export")
    parser.add_argument("--engines", default="eager,torch", help="comma-separated engines (default eager,torch)")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated (default 1,8,32)")
    parser.add_argument("--seconds", type=float, default=2.0, help="time budget per engine per batch size (default 2)")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where the JSON and PNG go")
    args = parser.parse_args()

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = args.engines.split(",")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    console = Console()
    with tempfile.TemporaryDirectory(prefix="tk-bench-") as tmp:
        artifact = args.artifact
        if artifact is None:
            artifact = Path(tmp) / "artifact"
            formats = tuple(dict.fromkeys(FORMAT_OF[e] for e in engines if e in FORMAT_OF)) or ("torch",)
            torch.manual_seed(0)
            export(build_model(args.model, size=args.size), artifact, ExportOptions(formats=formats))
        opened = {name: load(artifact, name) for name in engines}
        try:
            report = measure(opened, batch_sizes, seconds=args.seconds, progress=console.log)
        finally:
            for engine in opened.values():
                engine.close()
    report.settings["model"] = {"name": args.model, "size": args.size, "artifact": str(args.artifact or "")}
    console.print(render_table(report))
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    stem = args.out / f"{stamp}-{args.model}-{args.size}"
    save_json(report, stem.with_suffix(".json"))
    save_plot(report, stem.with_suffix(".png"))
    console.print(f"wrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    main()
