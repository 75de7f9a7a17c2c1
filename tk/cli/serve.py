"""``tk serve`` (Ray Serve, KServe v2 over HTTP) and ``tk deploy triton`` (a Triton model repository)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from tk.cli.common import RegistryChoice, engine_choice, trust_options, trust_policy
from tk.cli.serve_tuning import tune_command, tuning_options, with_settings
from tk.registries import ENGINES
from tk.serve.ingress import INGRESSES

if TYPE_CHECKING:
    from tk.runtime.choice import EngineChoice
    from tk.serve.lifecycle import RunningServer


@click.command("serve")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--name", default=None, help="Model name in the URLs (default: the manifest's model name).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--replicas", type=int, default=1, show_default=True, help="Replicas, each with its own engine.")
@click.option("--cpus-per-replica", type=float, default=1.0, show_default=True, help="Ray CPUs reserved per replica.")
@click.option("--gpus-per-replica", type=float, default=0.0, show_default=True, help="Ray GPUs reserved per replica.")
@click.option(
    "--max-batch", type=int, default=None, help="Samples per engine call (default: the artifact's batch max)."
)
@click.option(
    "--batching/--no-batching",
    default=True,
    show_default=True,
    help="Batch requests together; --no-batching runs each request alone.",
)
@click.option(
    "--max-delay-ms",
    type=float,
    default=0.0,
    show_default=True,
    help="Longest wait past the oldest queued request's arrival for a batch below --max-batch to fill, in "
    "milliseconds (0, as Triton's default: a batch is what queued while the engine ran); a request that "
    "arrives while no other is in flight never waits.",
)
@click.option(
    "--max-queue",
    type=int,
    default=64,
    show_default=True,
    help="Requests waiting for a replica before new ones get 503 (-1: unbounded).",
)
@click.option(
    "--request-timeout",
    type=float,
    default=20.0,
    show_default=True,
    help="Seconds after which the server answers a request with an error instead of letting it wait (a replica restarting).",
)
@click.option(
    "--ingress",
    type=click.Choice(list(INGRESSES)),
    default=INGRESSES[0],
    show_default=True,
    help="proxy: Ray Serve's Python proxy actor; haproxy: Ray Serve's HAProxy ingress, which forwards requests "
    "straight to the replicas' own HTTP servers (about 3 ms less per request on 2 cores; HAProxy's read-only "
    "stats page and Prometheus exporter then listen on every interface).",
)
@click.option("--address", default=None, help="Join this Ray cluster (default: start a local Ray instance).")
@click.option(
    "--max-request-bytes",
    default=None,
    help="Largest request body, in bytes (512K, 8M, ...); larger ones get 413 before they are read "
    "(default: the largest valid request at the artifact's max shapes, JSON or binary).",
)
@click.option(
    "--max-tokens",
    type=int,
    default=None,
    help="A decoder's most new tokens per request (default: its cache's slots less one); a request for more gets 400.",
)
@engine_choice(choices=RegistryChoice(ENGINES))
@tuning_options
def serve_cmd(
    artifact: Path,
    name: str | None,
    host: str,
    port: int,
    replicas: int,
    cpus_per_replica: float,
    gpus_per_replica: float,
    max_batch: int | None,
    batching: bool,
    max_delay_ms: float,
    max_queue: int,
    request_timeout: float,
    ingress: str,
    address: str | None,
    max_request_bytes: str | None,
    max_tokens: int | None,
    choice: EngineChoice,
    **tuning: Any,
) -> None:
    """Serve an artifact over HTTP (KServe v2, as Triton speaks it) with dynamic batching; Ctrl-C stops it.

    A decoder is served for generation: Triton's generate and generate_stream, and OpenAI's /v1/completions,
    every request decoded in one running batch (continuous batching).

    --config FILE starts from a settings file (flags given win); --tune load-tests a grid and writes one."""
    from tk.serve.config import ServeConfig
    from tk.serve.lifecycle import serve_forever

    config = ServeConfig(
        artifact=str(artifact),
        engine=choice,
        name=name,
        host=host,
        port=port,
        replicas=replicas,
        cpus_per_replica=cpus_per_replica,
        gpus_per_replica=gpus_per_replica,
        max_batch=max_batch,
        batching=batching,
        max_delay_ms=max_delay_ms,
        max_queue=max_queue,
        request_timeout_s=request_timeout,
        ingress=ingress,
        max_request_bytes=_request_bytes(max_request_bytes),
        max_tokens=max_tokens,
    )

    config = with_settings(config, tuning.pop("config_file"))
    if tuning.pop("tune"):
        _tune(config, address, tuning)
        return
    serve_forever(config, address=address, on_ready=_say_ready)
    click.echo("stopped", err=True)


def _tune(config: Any, address: str | None, tuning: dict[str, Any]) -> None:
    """``--tune``: the load test on a local Ray instance of its own, which writes the settings file."""
    from tk.errors import UsageError

    if address:
        raise UsageError(
            f"--tune: expected a local Ray instance of its own (it starts one), got --address {address}; "
            "tune on a machine like those that will serve, without --address"
        )
    from tk.manifest import verify_artifact

    if verify_artifact(config.artifact).generation:
        raise UsageError(
            "--tune: expected a one-call model (it load-tests /infer); a decoder is served with continuous batching "
            "up to --max-batch rows, and benchmarks/serve_generation.py measures its clients"
        )
    tune_command(config, **tuning)


def _say_ready(running: RunningServer) -> None:
    """Where the server listens and with which settings, once every replica is ready (stderr)."""
    resolved = running.config
    click.echo(
        f"serving {resolved.name} ({resolved.engine.name}, {resolved.replicas} replica(s), {resolved.ingress} ingress, "
        + (
            f"max batch {resolved.max_batch}, max delay {resolved.max_delay_ms:g} ms, "
            if resolved.batching
            else "no batching, "
        )
        + f"max queue {resolved.max_queue}, max request {resolved.max_request_bytes} bytes) at "
        + (
            f"{running.url}/v2/models/{resolved.name}/generate[_stream] and {running.url}/v1/completions; "
            if resolved.max_tokens is not None
            else f"{running.url}/v2/models/{resolved.name}/infer; "
        )
        + f"metrics at {running.url}/metrics; Ctrl-C stops",
        err=True,
    )
    if running.haproxy_ports:
        click.echo(
            f"HAProxy: statistics on port {running.haproxy_ports['stats']} (/stats) and Prometheus on port "
            f"{running.haproxy_ports['metrics']} (/metrics), on every interface",
            err=True,
        )


def _request_bytes(text: str | None) -> int | None:
    from tk.errors import UsageError
    from tk.limits import parse_size

    if text is None:
        return None
    try:
        return parse_size(text)
    except UsageError:
        raise UsageError(
            f"--max-request-bytes: expected a byte count such as 65536, 512K or 8M, got {text!r}"
        ) from None


@click.group("deploy")
def deploy_group() -> None:
    """Write deployment bundles for other servers."""


@deploy_group.command("triton")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Model repository directory.")
@click.option(
    "--format",
    "fmt",
    default=None,
    help="Which file Triton loads: a format a Triton backend serves (onnx, trt; default: the artifact's plan if "
    "it has one, else its onnx file).",
)
@click.option(
    "--name",
    default=None,
    help="Model name in the repository (default: the manifest's model name made safe; for hf:DIR, DIR's own name).",
)
@click.option("--instances", type=int, default=1, show_default=True, help="instance_group count.")
@click.option(
    "--max-queue-delay-us",
    type=int,
    default=1000,
    show_default=True,
    help="dynamic_batching max_queue_delay_microseconds.",
)
@click.option("--force", is_flag=True, help="Write into a non-empty --out (files of the same names are replaced).")
@trust_options
def deploy_triton_cmd(
    artifact: Path,
    out: Path,
    fmt: str | None,
    name: str | None,
    instances: int,
    max_queue_delay_us: int,
    force: bool,
) -> None:
    """Write a Triton model repository (config.pbtxt from the manifest, the model file, a warmup sample).

    A TensorRT plan is native code: it is deployed only from an artifact signed by a key you trust, or
    with --trust-artifact-code."""
    from tk.serve.triton import deploy_triton

    result = deploy_triton(
        artifact, out, fmt=fmt, name=name, instances=instances, max_queue_delay_us=max_queue_delay_us, force=force,
        trust=trust_policy(),
    )  # fmt: skip
    for path in result.files:
        click.echo(f"wrote {out / path}")
    config = result.config
    click.echo(
        f"{config.name}: {config.platform}, max_batch_size {config.max_batch_size}, "
        f"{len(config.input)} input(s), {len(config.output)} output(s)"
    )


COMMANDS = (serve_cmd, deploy_group)
