"""Issue 50's serving goal on this CPU: streaming clients of ``tk serve`` on a decoder, one alone against
eight at once, and their tokens against ``tk generate``'s.

    .venv/bin/python -m benchmarks.serve_generation [--size small] [--clients 8] [--prompt-len 32]
        [--new-tokens 64] [--rounds 3] [--threads 2] [--work DIR] [--out benchmarks/results]

The built-in decoder (random weights) is exported for onnx with a cache of ``prompt-len + new-tokens``
slots and served by ``tk serve`` on a local Ray instance (one replica, a decode batch of ``--clients``).
Each round: one client streams one request (``generate_stream``) alone, then ``--clients`` clients stream
one request each at once; tokens/s is the tokens received over the wall time from the first request sent
to the last event read. The tokens every client received are compared with ``tk generate``'s for its
prompt after the server stopped. Run it alone: it times a server against itself.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from tk.measure.results import BenchRun


def stream(port: int, name: str, prompt: list[int], new_tokens: int) -> tuple[list[int], float]:
    """One streamed generation: its tokens and the seconds to its first token."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    started = time.perf_counter()
    body = {"input_ids": prompt, "max_tokens": new_tokens, "temperature": 0}
    connection.request("POST", f"/v2/models/{name}/generate_stream", json.dumps(body))
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"generate_stream answered {response.status}: {response.read()[:200]!r}")
    tokens: list[int] = []
    first = 0.0
    for line in response:
        if line.startswith(b"data: "):
            tokens += json.loads(line[6:])["output_ids"]
            first = first or time.perf_counter() - started
    connection.close()
    return tokens, first


def clients_at_once(port: int, name: str, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Every prompt streamed by its own client at once: tokens per client, tokens/s over the wall time."""
    got: list[Any] = [None] * len(prompts)

    def client(index: int) -> None:
        got[index] = stream(port, name, prompts[index], new_tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    tokens = [g[0] for g in got]
    return {
        "tokens": tokens,
        "tokens_per_s": sum(map(len, tokens)) / wall,
        "wall_s": wall,
        "ttft_ms": [g[1] * 1e3 for g in got],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="small", help="built-in decoder size (tiny, small, base)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="onnxruntime threads of the replica")
    parser.add_argument("--work", type=Path, default=Path("/tmp/tk-serve-generation"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = parser.parse_args(argv)
    run = BenchRun("serve-generation", settings=vars(args))

    artifact = export(args)
    vocab = json.loads((artifact / "manifest.json").read_text())["generation"]["vocab_size"]
    prompts = [[(31 * c + 7 * j) % vocab for j in range(args.prompt_len - c)] for c in range(args.clients)]
    alone, together = [], []
    with served(artifact, args) as config:
        stream(config.port, config.name, prompts[0], 4)  # warm the route
        for _ in range(args.rounds):
            tokens, first = stream(config.port, config.name, prompts[0], args.new_tokens)
            started = time.perf_counter()
            tokens, first = stream(config.port, config.name, prompts[0], args.new_tokens)
            alone.append({"tokens_per_s": len(tokens) / (time.perf_counter() - started), "ttft_ms": first * 1e3})
            together.append(clients_at_once(config.port, config.name, prompts, args.new_tokens))
    same = identical_to_tk_generate(artifact, prompts, together[-1]["tokens"], args.new_tokens)
    one = statistics.median(r["tokens_per_s"] for r in alone)
    many = statistics.median(r["tokens_per_s"] for r in together)
    print(
        f"{args.size} decoder, onnx ({args.threads} threads), {args.prompt_len}-token prompts, {args.new_tokens} new:"
    )
    print(
        f"  1 client:  {one:8.1f} tokens/s  (time to first token {statistics.median(r['ttft_ms'] for r in alone):.1f} ms)"
    )
    print(f"  {args.clients} clients: {many:8.1f} tokens/s  ({many / one:.2f}x one client's)")
    print(f"  tokens identical to tk generate for {sum(same)} of {len(same)} clients")
    results = {"alone": alone, "together": [{k: v for k, v in r.items() if k != "tokens"} for r in together],
               "one_client_tokens_per_s": one, "clients_tokens_per_s": many, "ratio": many / one,
               "identical_to_tk_generate": same}  # fmt: skip
    print(f"results: {run.write(results, args.out)}")


def export(args: argparse.Namespace) -> Path:
    from click.testing import CliRunner

    from tk.cli import cli

    out = args.work / f"decoder-{args.size}-{args.prompt_len + args.new_tokens}"
    if not (out / "manifest.json").exists():
        result = CliRunner().invoke(cli, ["export", "decoder", "--size", args.size, "--format", "onnx", "--out",
                                          str(out), "--max-cache-len", str(args.prompt_len + args.new_tokens)])  # fmt: skip
        if result.exit_code != 0:
            raise SystemExit(result.output)
    return out


def served(artifact: Path, args: argparse.Namespace) -> Any:
    import contextlib

    from tk.runtime.choice import EngineChoice
    from tk.serve.config import ServeConfig
    from tk.serve.ingress import free_ports
    from tk.serve.lifecycle import start, stop

    @contextlib.contextmanager
    def running() -> Any:
        config = ServeConfig(str(artifact), engine=EngineChoice("onnx", options={"threads": args.threads}),
                             port=free_ports(1)[0], max_batch=args.clients, request_timeout_s=600.0)  # fmt: skip
        server = start(config, num_cpus=2)
        try:
            yield server.config
        finally:
            stop(server)

    return running()


def identical_to_tk_generate(artifact: Path, prompts: list[list[int]], got: list[list[int]], new: int) -> list[bool]:
    from tk.runtime import load

    with load(artifact, engine="onnx") as engine:
        return [
            engine.generate([p], max_new_tokens=new, stop_ids=[]).tokens[0] == g
            for p, g in zip(prompts, got, strict=True)
        ]


if __name__ == "__main__":
    main()
