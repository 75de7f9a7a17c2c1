"""The ``aoti`` engine: an AOTInductor package, loaded with ``torch._inductor.aoti_load_package`` (on the CPU
with its constants aligned to cache lines: ``tk.runtime.aoti_package``).

A package runs only where it can: on the device it was compiled for, on a CPU with the vector
instructions it was compiled for, under the torch minor version that built it. Anything else is
refused with the command that rebuilds it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from tk.errors import BackendUnavailableError, load_failure
from tk.formats.aoti import PACKING_FEATURES, packing_features, supported_vector_isas, torch_minor
from tk.manifest import read_verified
from tk.runtime.aoti_package import open_package
from tk.runtime.base import Engine, rebuild_command
from tk.runtime.torch_engine import TorchEngine
from tk.signing import require_trusted_code


class AOTInductorEngine(TorchEngine):
    name = "aoti"

    @classmethod
    def probe_call(cls, model: Any, feeds: dict[str, Any], like: Engine,
                   options: Mapping[str, Any] | None = None) -> Callable[[], object]:  # fmt: skip
        package = open_package(model().read_bytes(), like.device)  # compiled by this process a moment ago
        args = tuple(torch.from_numpy(feeds[spec.name]) for spec in like.inputs)

        def run() -> object:
            with torch.no_grad():
                return package(*args)

        return run

    def _load_model(self) -> None:
        require_trusted_code(self.root, self.manifest, self.trust, self.name)  # before any of its code loads
        self._refuse_foreign_package()
        entry = self.manifest.file("aoti")
        path = self.root / entry.path
        data = read_verified(self.root, entry)
        try:
            self._model = open_package(data, self.device)
        except Exception as exc:  # a RuntimeError from the C++ loader, mostly
            fix = f"rebuild it with `{rebuild_command(self.manifest, 'aoti', self.device)}`"
            raise load_failure(exc, f"{path} (AOTInductor)", fix) from exc

    def _refuse_foreign_package(self) -> None:
        settings = self.manifest.formats.get("aoti", {})
        rebuild = rebuild_command(self.manifest, "aoti", self.device)
        built_for = settings.get("device", self.manifest.device)
        if built_for != self.device:
            raise BackendUnavailableError(
                f"{self.root}: the AOTInductor package was compiled for {built_for}, and {self.device} was "
                f"requested; run it with --device {built_for}, or rebuild it with `{rebuild}`"
            )
        built_torch = str(self.manifest.versions.get("torch", ""))
        if built_torch and torch_minor(built_torch) != torch_minor(torch.__version__):
            raise BackendUnavailableError(
                f"{self.root}: the AOTInductor package was compiled by torch {built_torch}, this is torch "
                f"{torch.__version__}; packages only load under the torch version that built them: rebuild it with `{rebuild}`"
            )
        isa = settings.get("cpu_isa")
        if self.device == "cpu" and isa:
            here = supported_vector_isas()
            if here is not None and isa not in here:
                raise BackendUnavailableError(
                    f"{self.root}: the AOTInductor package uses {isa} instructions, which this CPU lacks "
                    f"(it has {', '.join(here) or 'none'}); rebuild it here with `{rebuild}`"
                )
        packed_for = settings.get("packed_for")
        features = packing_features()
        if self.device == "cpu" and packed_for is not None and features is not None and packed_for != features:
            raise BackendUnavailableError(
                f"{self.root}: the AOTInductor package's weights were packed by oneDNN for a CPU with "
                f"{', '.join(packed_for) or 'none of ' + ', '.join(sorted(PACKING_FEATURES))}; this CPU has "
                f"{', '.join(features) or 'none of them'}: rebuild it here with `{rebuild}`"
            )

    def _forward(self, *args: torch.Tensor) -> Any:
        return self._model(*args)

    def _close(self) -> None:
        del self._model
        if self.device == "cuda":
            torch.cuda.empty_cache()
