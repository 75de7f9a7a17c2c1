"""Continuous batching of decode steps: sequences join and leave one running batch between steps.

``tk.runtime.generation.generate`` runs a fixed set of prompts to the end. A server cannot wait for the
slowest row before taking new requests, so ``DecodeBatch`` keeps every running sequence's cache rows in
one batch: each ``step()`` runs one decode step for all of them, ``admit()`` prefills newcomers (together,
left-padded) and appends their rows, and a finished or cancelled row is dropped between steps.

The loop writes the new tokens at ``cache_position``, the same slots for every row, and a
row's attention mask says which slots hold its tokens; positions are carried by ``position_ids``, not by
the slot. So rows need not start at the same slot: every row writes its next token at the batch's
``slot``, and newcomers' prompts are prefilled to end there. Attention over the slots a mask allows does
not depend on where they lie, so when the batch runs short of slots its cache is moved left to the
oldest live row's first slot (or right, to make room for a longer prompt): the same keys, the same tokens.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tk.runtime.generation import CacheLayout, KeptCache, Sampling, Step, choose, left_padded


@dataclass
class Row:
    """One request's sequence in the batch; ``tokens`` are its new tokens so far (a stop token kept)."""

    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling = field(default_factory=Sampling)
    stop_ids: frozenset[int] = frozenset()
    ident: int = field(default_factory=itertools.count().__next__)
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None  # "stop", "length" or "cancelled" once it has ended
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if not self.sampling.greedy:
            self.generator = torch.Generator().manual_seed(self.sampling.seed)

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.tokens)


class DecodeBatch:
    """The running batch of one engine (``step``: one run of a decoder artifact's graph) with at most
    ``max_rows`` sequences; not thread-safe (one caller drives it)."""

    def __init__(
        self, step: Step, layout: CacheLayout, max_rows: int, pad_id: int = 0, kept: KeptCache | None = None
    ) -> None:
        self._step = step
        # an engine that keeps the cache (OpenVINO's stateful IR) decodes on what it holds; the batch's own
        # cache is brought up to date from it only when rows join or leave, and handed back at the next step
        self.kept = kept
        self._in_engine = False
        self.layout = layout
        self.max_rows = max(1, int(max_rows))
        self.pad_id = pad_id
        self.rows: list[Row] = []
        self.keys = layout.empty(0)
        self.values = layout.empty(0)
        self.mask = torch.zeros((0, layout.slots), dtype=torch.int64)
        self.positions = torch.zeros((0, 1), dtype=torch.int64)  # each row's next position id
        self.slot = 0  # where every row's next token is written
        self.moves = 0  # times the cache was moved to make room

    # -- room ------------------------------------------------------------------------------------
    def _span(self) -> int:
        """Slots from the oldest live row's first token to ``slot``."""
        if not self.rows:
            return 0
        first = int(self.mask.any(dim=0).int().argmax())
        return self.slot - first

    def _end_for(self, newcomers: Sequence[Row]) -> int | None:
        """The slot where the batch's next tokens would go with ``newcomers`` admitted, or None: no room."""
        if len(self.rows) + len(newcomers) > self.max_rows:
            return None
        longest = max(len(s.prompt) for s in newcomers)
        need = max(s.remaining for s in [*self.rows, *newcomers])
        if self.rows and self.slot >= longest and self.slot + need <= self.layout.slots:
            return self.slot  # no move needed
        end = max(self._span(), longest)  # the live rows moved to the cache's start
        return end if end + need <= self.layout.slots else None

    def room_for(self, newcomers: Sequence[Row]) -> bool:
        return self._end_for(newcomers) is not None

    def _pull(self) -> None:
        """The slots the engine's cache holds copied into the batch's own, before rows join, leave or move."""
        if self.kept is not None and self._in_engine:
            keys, values = self.kept.read(0, self.slot)
            self.keys[:, :, :, : self.slot] = torch.from_numpy(keys)
            self.values[:, :, :, : self.slot] = torch.from_numpy(values)
        self._in_engine = False

    def _move_to(self, end: int) -> None:
        """Move every row's cache and mask so that ``slot`` becomes ``end`` (the live slots stay in range)."""
        shift = end - self.slot
        if shift and self.rows:
            self.keys = torch.roll(self.keys, shift, dims=3)
            self.values = torch.roll(self.values, shift, dims=3)
            self.mask = torch.roll(self.mask, shift, dims=1)
            self.moves += 1
        self.slot = end

    # -- steps -----------------------------------------------------------------------------------
    def admit(self, newcomers: Sequence[Row]) -> list[tuple[Row, int]]:
        """Prefill ``newcomers`` together and add them to the batch; their first tokens. Call only when
        ``room_for(newcomers)``."""
        end = self._end_for(newcomers)
        if end is None or not newcomers:
            raise ValueError("no room in the decode batch for these sequences")
        self._pull()
        self._move_to(end)
        prompts = [s.prompt for s in newcomers]
        ids, positions, short_mask = left_padded(prompts, self.layout.slots, self.pad_id)
        width = ids.shape[1]
        mask = torch.roll(short_mask, end - width, dims=1)  # the prompts end at ``end``
        keys, values = self.layout.empty(len(newcomers)), self.layout.empty(len(newcomers))
        result = self._run(ids, positions, torch.arange(end - width, end), mask, keys, values)
        keys[:, :, :, end - width : end] = result["present_keys"]
        values[:, :, :, end - width : end] = result["present_values"]
        self.rows += newcomers
        self.keys = torch.cat([self.keys, keys])
        self.values = torch.cat([self.values, values])
        self.mask = torch.cat([self.mask, mask])
        self.positions = torch.cat([self.positions, positions[:, -1:] + 1])
        return self._chosen(newcomers, result["logits"])

    def step(self) -> list[tuple[Row, int]]:
        """One decode step of every live row: feed each row's last token at ``slot``; their next tokens."""
        live = [s for s in self.rows if s.finish is None]
        if len(live) != len(self.rows):
            self.drop([s for s in self.rows if s.finish is not None])
        if not self.rows:
            return []
        ids = torch.tensor([[s.tokens[-1]] for s in self.rows], dtype=torch.int64)
        self.mask[:, self.slot] = 1
        if self.kept is not None:
            if not self._in_engine:
                self.kept.write(self.keys, self.values, self.slot)
                self._in_engine = True
            feeds = {"input_ids": ids, "position_ids": self.positions, "attention_mask": self.mask[:, : self.slot + 1]}
            result = {"logits": torch.from_numpy(self.kept.step({k: v.numpy() for k, v in feeds.items()}))}
        else:
            result = self._run(ids, self.positions, torch.tensor([self.slot]), self.mask, self.keys, self.values)
            self.keys[:, :, :, self.slot] = result["present_keys"][:, :, :, 0]
            self.values[:, :, :, self.slot] = result["present_values"][:, :, :, 0]
        self.positions = self.positions + 1
        self.slot += 1
        return self._chosen(self.rows, result["logits"])

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, cache_position: torch.Tensor, mask: torch.Tensor,
             keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:  # fmt: skip
        feeds = {"input_ids": ids, "position_ids": positions, "cache_position": cache_position,
                 "attention_mask": mask, "past_keys": keys, "past_values": values}  # fmt: skip
        return {name: value.detach().cpu() for name, value in self._step(feeds).items()}

    def _chosen(self, rows: Sequence[Row], logits: torch.Tensor) -> list[tuple[Row, int]]:
        """Each row's next token, recorded; a row ends at a stop token or its last token."""
        greedy = logits.argmax(dim=-1).tolist()
        chosen = []
        for index, seq in enumerate(rows):
            if seq.sampling.greedy:
                token = greedy[index]
            else:
                token = int(choose(logits[index : index + 1], seq.sampling, seq.generator)[0])
            seq.tokens.append(token)
            if token in seq.stop_ids:
                seq.finish = "stop"
            elif seq.remaining <= 0:
                seq.finish = "length"
            chosen.append((seq, token))
        return chosen

    def drop(self, ended: Sequence[Row]) -> None:
        """Take ``ended`` sequences (finished or cancelled) out of the batch; an empty batch starts at slot 0."""
        gone = {s.ident for s in ended}
        keep = [i for i, s in enumerate(self.rows) if s.ident not in gone]
        if len(keep) == len(self.rows):
            return
        self._pull()
        index = torch.tensor(keep, dtype=torch.int64)
        self.rows = [self.rows[i] for i in keep]
        self.keys, self.values = self.keys[index], self.values[index]
        self.mask, self.positions = self.mask[index], self.positions[index]
        if not self.rows:
            self.slot = 0
