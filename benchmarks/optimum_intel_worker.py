"""optimum-intel's OpenVINO model as a rival, run in its own Python (optimum-intel 2.2 needs transformers 4;
tk runs transformers 5): ``benchmarks.decoder_goals --optimum-intel PYTHON`` starts it as

    PYTHON benchmarks/optimum_intel_worker.py MODEL_DIR f32|bf16

It exports ``MODEL_DIR`` with ``OVModelForCausalLM.from_pretrained(export=True)`` (offline, weights not
compressed: the models here are far below the 1B parameters where optimum-intel compresses by default),
compiles it for the CPU at that inference precision, prints ``ready``, then answers one JSON line per
request line ``{"prompt": [ids], "new_tokens": N}`` with ``{"ttft": s, "steps": [s, ...], "tokens": [ids]}``:
greedy ``generate`` at batch 1, timed by a streamer that notes each token (one call, as tk's transformers
rival). This file imports nothing of tk: the other Python has no tk.
"""

from __future__ import annotations

import itertools
import json
import sys
import time


class TokenClock:
    def __init__(self) -> None:
        self.ticks: list[float] = []
        self.tokens: list[int] = []

    def put(self, value) -> None:  # noqa: ANN001 (transformers' streamer protocol: a tensor of ids)
        self.ticks.append(time.perf_counter())
        self.tokens.append(value.reshape(-1).tolist())

    def end(self) -> None:
        pass


def main() -> None:
    import torch
    from optimum.intel import OVModelForCausalLM

    directory, precision = sys.argv[1], sys.argv[2]
    model = OVModelForCausalLM.from_pretrained(
        directory, export=True, load_in_8bit=False, local_files_only=True,
        ov_config={"INFERENCE_PRECISION_HINT": precision},
    )  # fmt: skip
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        ids = torch.tensor([request["prompt"]], dtype=torch.int64)
        count = int(request["new_tokens"])
        clock = TokenClock()
        started = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=count,
                       min_new_tokens=count, eos_token_id=None, pad_token_id=0, streamer=clock)  # fmt: skip
        ticks = clock.ticks[1:]  # the first put is the prompt, before the prefill
        reply = {"ttft": ticks[0] - started, "steps": [b - a for a, b in itertools.pairwise(ticks)],
                 "tokens": [t[0] for t in clock.tokens[1:]]}  # fmt: skip
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
