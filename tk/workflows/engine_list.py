"""Which engines a check or benchmark runs: ``all`` (every engine this machine runs for an artifact, less
those whose native code is not trusted) or the names given."""

from __future__ import annotations

from pathlib import Path

from tk.errors import UsageError
from tk.manifest import Manifest
from tk.registries import ENGINES
from tk.runtime import available_engines, trusted_engines
from tk.signing import TrustPolicy


def engines_to_check(
    text: str,
    manifest: Manifest,
    device: str,
    *,
    baselines: tuple[str, ...] = (),
    keep_eager: bool = False,
    root: str | Path | None = None,
    trust: TrustPolicy | None = None,
) -> list[str]:
    """``all`` (every engine this machine runs for the artifact) or a comma-separated list.

    With ``all``/``auto`` and ``root``, engines that would run native code ``trust`` does not
    allow are left out with a note (a named one is refused when it loads). ``baselines`` come first. Eager (the reference of a check) is left out unless ``keep_eager``
    or it is a baseline; an empty list is an error.
    """
    if text in ("all", "auto"):
        names = available_engines(manifest, device)
        if root is not None:
            names = trusted_engines(root, manifest, names, trust)
    else:
        names = [n.strip() for n in text.split(",") if n.strip()]
        unknown = [n for n in names if n not in ENGINES]
        if unknown:
            raise UsageError(
                f"--engine: unknown {', '.join(unknown)}; expected names from {', '.join(ENGINES)}, or all"
            )
    names = [b for b in baselines if b not in names] + names
    if not (keep_eager or "eager" in baselines):
        names = [n for n in names if n != "eager"]
    if not names:
        eager = " (eager is the reference each engine is compared with; name another engine, or --reference ENGINE)"
        raise UsageError(
            f"no engine to compare: the artifact holds {', '.join(e.role for e in manifest.files)}"
            + (eager if text.strip() == "eager" else "")
        )
    return names
