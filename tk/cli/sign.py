"""``tk sign``: sign an artifact (``ARTIFACT/model.sig``), or show the public key others need to trust yours."""

from __future__ import annotations

from pathlib import Path

import click

from tk.errors import UsageError


@click.command("sign")
@click.argument("artifact", type=click.Path(path_type=Path), required=False)
@click.option(
    "--private-key",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="PEM elliptic-curve private key to sign with (default: your own key, made on first use).",
)
@click.option(
    "--show-public-key",
    is_flag=True,
    help="Print the path of your public key (made on first use): hand that file to whoever loads your artifacts.",
)
def sign_cmd(artifact: Path | None, private_key: Path | None, show_public_key: bool) -> None:
    """Sign ARTIFACT with OpenSSF model signing: ARTIFACT/model.sig covers every file of it.

    Verify it with `model_signing verify key ARTIFACT --signature ARTIFACT/model.sig --public_key PUB`.
    """
    from tk.keys import ensure_own_key, fingerprint_of_file
    from tk.signing import sign_artifact

    if show_public_key:
        if artifact is not None or private_key is not None:
            raise UsageError("--show-public-key takes no ARTIFACT and no --private-key")
        public = ensure_own_key()[1]
        click.echo(f"{public}  (fingerprint {fingerprint_of_file(public)})")
        return
    if artifact is None:
        raise UsageError("expected an ARTIFACT directory to sign (or --show-public-key)")
    from tk.manifest import verify_artifact

    verify_artifact(artifact)  # sign only a whole artifact whose files match its manifest
    fingerprint = sign_artifact(artifact, private_key)
    click.echo(f"signed {Path(artifact) / 'model.sig'} with key {fingerprint}")


COMMANDS = (sign_cmd,)
