"""Typed configs, validated at the boundary. Each component receives only its own sub-config."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

from raysd.models import DEMO_DRAFT, DEMO_TARGET


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpeculationMode(str, Enum):
    """How a request (or the whole engine) uses speculation."""

    off = "off"  # plain decoding, k = 0
    on = "on"  # fixed k every round
    adaptive = "adaptive"  # the policy picks k per sequence and round


class DrafterKind(str, Enum):
    model = "model"  # a small draft LM
    ngram = "ngram"  # prompt lookup: continue the latest earlier match of the last n tokens


class ModelConfig(_Strict):
    """Where the target and draft models live (local Hugging Face directories only)."""

    target: Path = Field(default=DEMO_TARGET, description="Target model directory.")
    draft: Path | None = Field(default=DEMO_DRAFT, description="Draft model directory (model drafter).")


class DrafterConfig(_Strict):
    """The drafter: which kind, and the n-gram drafter's match window."""

    kind: DrafterKind = Field(default=DrafterKind.model, description="model or ngram.")
    ngram_max: int = Field(default=4, ge=1, description="Longest suffix the n-gram drafter matches.")
    ngram_min: int = Field(default=1, ge=1, description="Shortest suffix the n-gram drafter matches.")

    @model_validator(mode="after")
    def _ngram_window(self):
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"ngram_min ({self.ngram_min}) must be ≤ ngram_max ({self.ngram_max})")
        return self


class PolicyConfig(_Strict):
    """How k is chosen: measured acceptance per segment, online cost model, pressure gate."""

    mode: SpeculationMode = Field(default=SpeculationMode.adaptive, description="off | on | adaptive.")
    k: int = Field(default=4, ge=0, le=16, description="k for mode=on and during a segment's warm-up.")
    k_max: int = Field(default=8, ge=0, le=16, description="Largest k the adaptive policy may choose.")
    ema_decay: float = Field(default=0.95, gt=0, lt=1, description="EMA decay of per-segment acceptance.")
    warmup_rounds: int = Field(default=8, ge=0, description="Rounds a segment runs at k before adapting.")
    min_gain: float = Field(default=1.05, ge=1.0,
                            description="Speculate only if predicted goodput beats plain decoding by this.")
    pressure_high: float = Field(default=28, gt=0,
                                 description="Sequences per verify step (running + waiting, summed over the "
                                             "cluster) above which speculation turns off for everyone. The "
                                             "default fits the demo pair on 2 CPU cores, where always-on k=4 "
                                             "stops paying near 32; set it from a sweep on your hardware.")
    pressure_low: float = Field(default=16, ge=0,
                                description="Pressure below which speculation turns back on (hysteresis).")
    pressure_reopen_s: float = Field(default=0.5, ge=0,
                                     description="Seconds pressure must have stayed below pressure_low before "
                                                 "speculation turns back on. Finished requests replaced by new "
                                                 "ones dip the load for a round; reopening there makes the draft "
                                                 "catch up on every row for a round or two of drafting.")
    probe_every: int = Field(default=32, ge=1,
                             description="A segment held at k=0 for low acceptance re-measures (a short "
                                         "draft for the row the draft is least behind on) every this many "
                                         "rounds, so it can recover: sooner where a probe about pays for "
                                         "itself, later where one would cost more than 2% of the rounds "
                                         "between (one row's drafts widen a big batch's verify).")
    cost_decay: float = Field(default=0.98, gt=0, lt=1, description="Forgetting factor of the cost fit.")
    speculate_prefill: bool = Field(default=False,
                                    description="Also draft in a sequence's first round. Off (default): the first "
                                                "round only prefills and emits the first token, as without "
                                                "speculation, so time to first token does not pay for drafting.")

    @model_validator(mode="after")
    def _bounds(self):
        if self.pressure_low >= self.pressure_high:
            raise ValueError(f"pressure_low ({self.pressure_low}) must be below pressure_high "
                             f"({self.pressure_high}) for hysteresis")
        if self.k > self.k_max and self.mode == SpeculationMode.adaptive:
            raise ValueError(f"k ({self.k}) must be ≤ k_max ({self.k_max})")
        return self


class EngineConfig(_Strict):
    """Capacity of the in-process engine."""

    max_num_seqs: int = Field(default=32, gt=0, description="Sequences decoded together at most.")
    max_model_len: int = Field(default=1024, gt=1, description="Prompt + generated tokens per sequence.")
    threads: int | None = Field(default=None, gt=0, description="torch threads (None: leave as is).")


class SamplingParams(_Strict):
    """Per-request decoding parameters (OpenAI ranges)."""

    max_tokens: int = Field(default=64, ge=1, description="Tokens to generate at most.")
    temperature: float = Field(default=0.0, ge=0, le=2, description="0 = greedy.")
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus mass.")
    top_k: int = Field(default=0, ge=0, description="Top-k cut (0 = off).")
    seed: int | None = Field(default=None, description="Seed of this request's sampler.")
    ignore_eos: bool = Field(default=False, description="Keep generating past EOS (exactly max_tokens).")
    speculation: SpeculationMode | None = Field(default=None,
                                                description="off opts this request out; None follows policy.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
