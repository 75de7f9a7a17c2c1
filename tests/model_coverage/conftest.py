"""The coverage suite's session: the Hugging Face directories, saved once, and the run that exports each
architecture once, whichever tests ask for it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.model_coverage.catalog import save_hf_models
from tests.model_coverage.cells import CoverageRun
from tests.model_coverage.table import OUT_ENV


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    return save_hf_models(tmp_path_factory.mktemp("coverage-hf"))


@pytest.fixture(scope="session")
def coverage_run(tmp_path_factory: pytest.TempPathFactory, hf_dirs: dict[str, Path]) -> CoverageRun:
    pytest.importorskip("torchvision")
    pytest.importorskip("openvino")
    return CoverageRun(tmp_path_factory.mktemp("coverage-artifacts"), hf_dirs)


@pytest.fixture(scope="session")
def results_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get(OUT_ENV)
    return Path(given) if given else tmp_path_factory.mktemp("coverage-results")
