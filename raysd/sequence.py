"""The state of one sequence being decoded, and its speculation statistics."""

from __future__ import annotations

import itertools
import secrets
from dataclasses import dataclass, field

import torch

from raysd.config import SamplingParams

_ids = itertools.count()
_PROCESS_TAG = secrets.token_hex(4)  # sequences from different routers share target workers: ids must not clash


def new_seq_id() -> str:
    return f"seq-{_PROCESS_TAG}-{next(_ids)}"


def process_tag() -> str:
    """This process's tag, part of every sequence id it makes (a router's identity in the cluster)."""
    return _PROCESS_TAG


def origin_of(seq_id: str) -> str:
    """The tag of the process (router) that made ``seq_id``."""
    return seq_id.split("-")[1] if seq_id.count("-") >= 2 else ""


@dataclass
class SequenceStats:
    """Per-request speculation figures (vLLM's names in the API layer)."""

    rounds: int = 0  # verify steps this sequence took part in
    spec_rounds: int = 0  # rounds with k ≥ 1
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    last_reason: str = ""
    rounds_by_reason: dict[str, int] = field(default_factory=dict)  # the policy's reason → rounds it decided

    def record_round(self, reason: str, drafted: int, accepted: int) -> None:
        self.rounds += 1
        self.last_reason = reason
        self.rounds_by_reason[reason] = self.rounds_by_reason.get(reason, 0) + 1
        if drafted > 0:
            self.spec_rounds += 1
            self.drafted_tokens += drafted
            self.accepted_tokens += accepted
            self.accepted_per_position.extend([0] * (accepted - len(self.accepted_per_position)))
            for position in range(accepted):
                self.accepted_per_position[position] += 1

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Emitted tokens per speculative round (1 + accepted / spec rounds)."""
        return 1 + self.accepted_tokens / self.spec_rounds if self.spec_rounds else None


@dataclass
class Sequence:
    """A prompt and what has been generated for it. ``token_ids`` holds prompt + generated tokens."""

    prompt_token_ids: list[int]
    params: SamplingParams
    segment: str = "default"
    seq_id: str = field(default_factory=new_seq_id)
    token_ids: list[int] = field(default_factory=list)
    stats: SequenceStats = field(default_factory=SequenceStats)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    base_seed: int = 0  # sampling randomness derives from (base_seed, round, purpose); see round_generator
    admitted_at: float | None = None  # perf_counter when it joined the batch
    finished_at: float | None = None
    # tokens of ``token_ids`` the draft holds in its cache, as of the last round this sequence drafted (0: it
    # never drafted); what it missed since must be fed to it before it drafts again
    draft_cached: int = 0

    @property
    def draft_behind(self) -> int:
        """Tokens the draft must be fed before it can draft for this sequence (all but the last, which the
        first draft step feeds)."""
        return max(0, len(self.token_ids) - 1 - self.draft_cached)

    def __post_init__(self):
        if not self.prompt_token_ids:
            raise ValueError("prompt must encode to at least one token")
        self.token_ids = list(self.prompt_token_ids)
        self.base_seed = self.params.seed if self.params.seed is not None else secrets.randbits(62)

    def round_generator(self, purpose: str) -> torch.Generator:
        """A generator for this sequence's current round and ``purpose`` ("draft" / "verify").

        Counter-based: the stream depends only on (seed, round, purpose), never on the batch, the process
        or the order of calls — so drafter and verifier may live in different processes.
        """
        offset = {"draft": 1, "verify": 2}[purpose]
        return torch.Generator().manual_seed((self.base_seed * 1_000_003 + self.stats.rounds * 4 + offset)
                                             % (2**63 - 1))

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def remaining(self) -> int:
        return self.params.max_tokens - self.num_generated

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, new_token_ids: list[int], eos_token_id: int | None) -> list[int]:
        """Append emitted tokens, stopping at EOS (unless ignore_eos) or max_tokens; returns those kept."""
        kept = []
        for token_id in new_token_ids:
            if self.remaining <= 0:
                break
            self.token_ids.append(token_id)
            kept.append(token_id)
            if token_id == eos_token_id and not self.params.ignore_eos:
                self.finish_reason = "stop"
                return kept
        if self.remaining <= 0:
            self.finish_reason = "length"
        return kept
