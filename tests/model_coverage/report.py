"""``python -m tests.model_coverage.report``: the coverage suite's table without pytest.

Exports every architecture of the catalog (a few minutes on two cores), writes ``coverage.md`` and its JSON
twin ``coverage.json`` under ``--out``, and rewrites the table of docs/coverage.md (``--no-docs``: not).
``--from coverage.json`` renders a twin written before (by the suite with ``TK_COVERAGE_OUT``) instead.
Artifacts and the signing key live in a temporary directory, never in the user's own configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.model_coverage.cells import Cell, CoverageRun
from tests.model_coverage.table import cells_from_json, machine, write_docs, write_results

META_KEYS = ("date", "cpu", "cores", "cpu_flags", "versions")


def _measured(work: Path) -> tuple[list[Cell], dict[str, Any]]:
    from tests.model_coverage.catalog import save_hf_models

    os.environ["XDG_CONFIG_HOME"] = str(work / "config")  # the artifacts' signing key: a throwaway one
    run = CoverageRun(work / "artifacts", save_hf_models(work / "hf"))
    return run.all_cells(), machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.model_coverage.report", description=__doc__.split("\n\n")[0])
    parser.add_argument("--from", dest="source", type=Path, help="render this coverage.json instead of exporting")
    parser.add_argument("--out", type=Path, default=Path("coverage-results"), help="where coverage.md/.json go")
    parser.add_argument("--no-docs", action="store_true", help="leave docs/coverage.md as it is")
    args = parser.parse_args(argv)
    if args.source is not None:
        data = json.loads(args.source.read_text())
        cells, meta = cells_from_json(data), {key: data[key] for key in META_KEYS}
    else:
        with tempfile.TemporaryDirectory(prefix="tk-coverage-") as work:
            cells, meta = _measured(Path(work))
    markdown, twin = write_results(cells, meta, args.out)
    if not args.no_docs:
        write_docs(cells, meta)
    passed = sum(c.verdict == "passed" for c in cells)
    print(f"{passed} of {len(cells)} cells pass; table: {markdown}, JSON: {twin}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
