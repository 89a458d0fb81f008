"""Train the demo pair from scratch: tokenizer → target (CE) → draft (CE, then KL-distilled from the target).

Seeded and resumable: each stage checkpoints every ``checkpoint_every`` steps under the work dir and picks
up from its last checkpoint when run again; a finished stage is skipped. Progress bars show loss,
tokens/s and the ETA.
"""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from raysd.demo.corpus import WORKLOADS, read_documents
from raysd.demo.tokenizer import EOS_TOKEN, train_tokenizer


class ArchitectureSpec(BaseModel):
    """A Llama architecture; the vocabulary size comes from the tokenizer."""

    model_config = ConfigDict(extra="forbid")
    hidden_size: int = Field(gt=0, description="Residual width.")
    num_hidden_layers: int = Field(gt=0, description="Decoder layers.")
    num_attention_heads: int = Field(gt=0, description="Query heads.")
    num_key_value_heads: int = Field(gt=0, description="KV heads (GQA when fewer than query heads).")
    intermediate_size: int = Field(gt=0, description="MLP width.")
    max_position_embeddings: int = Field(default=2048, gt=0, description="Longest context (RoPE).")


class StageSpec(BaseModel):
    """One training stage's optimisation schedule."""

    model_config = ConfigDict(extra="forbid")
    steps: int = Field(gt=0, description="Optimizer steps.")
    batch_size: int = Field(gt=0, description="Sequences per step.")
    seq_len: int = Field(gt=1, description="Tokens per sequence.")
    learning_rate: float = Field(gt=0, description="Peak learning rate (cosine decay to 10%).")
    warmup_steps: int = Field(default=100, ge=0, description="Linear warm-up steps.")
    kl_weight: float = Field(default=0.0, ge=0, le=1, description="Weight of KL(target‖draft); rest CE.")
    distill_temperature: float = Field(default=1.0, gt=0, description="Softmax temperature for the KL.")


class DemoTrainConfig(BaseModel):
    """Everything ``raysd demo train`` needs; the defaults reproduce the shipped pair."""

    model_config = ConfigDict(extra="forbid")
    seed: int = Field(default=0, description="Seeds torch, numpy and batch sampling.")
    vocab_size: int = Field(default=8192, gt=256, description="BPE vocabulary size.")
    tokenizer_bytes_per_workload: int = Field(default=4_000_000, gt=0,
                                              description="Training text per workload for the BPE.")
    mixture: dict[str, float] = Field(default={"code": 0.5, "json": 0.2, "prose": 0.3},
                                      description="Share of training windows drawn from each workload.")
    target: ArchitectureSpec = ArchitectureSpec(
        hidden_size=384, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
        intermediate_size=1024)
    draft: ArchitectureSpec = ArchitectureSpec(
        hidden_size=192, num_hidden_layers=2, num_attention_heads=3, num_key_value_heads=1,
        intermediate_size=512)
    target_stage: StageSpec = StageSpec(steps=2300, batch_size=16, seq_len=256, learning_rate=2e-3)
    draft_stage: StageSpec = StageSpec(steps=600, batch_size=16, seq_len=256, learning_rate=3e-3)
    distill_stage: StageSpec = StageSpec(steps=800, batch_size=16, seq_len=256, learning_rate=1.5e-3,
                                         warmup_steps=50, kl_weight=0.9)
    checkpoint_every: int = Field(default=100, gt=0, description="Steps between checkpoints.")
    threads: int = Field(default=2, gt=0, description="torch intra-op threads.")


# ----------------------------------------------------------------------------------------------- data
class TokenStreams:
    """Per-workload token arrays (documents joined by EOS), encoded once and cached as ``.npy``."""

    def __init__(self, corpus_dir: Path, tokenizer, cache_dir: Path):
        self.arrays: dict[tuple[str, str], np.ndarray] = {}
        cache_dir.mkdir(parents=True, exist_ok=True)
        for workload in WORKLOADS:
            for split in ("train", "heldout"):
                cache = cache_dir / f"{workload}_{split}.npy"
                if not cache.exists():
                    documents = read_documents(corpus_dir / workload / f"{split}.txt")
                    ids: list[int] = []
                    for encoded in tokenizer(documents, add_special_tokens=False)["input_ids"]:
                        ids.extend(encoded)
                        ids.append(tokenizer.eos_token_id)
                    np.save(cache, np.asarray(ids, dtype=np.uint16))
                self.arrays[(workload, split)] = np.load(cache)

    def sample(self, rng: np.random.Generator, mixture: dict[str, float], batch_size: int,
               seq_len: int) -> torch.Tensor:
        """Random windows ``[batch_size, seq_len]`` from the training splits, workloads by ``mixture``."""
        names = sorted(mixture)
        weights = np.asarray([mixture[name] for name in names], dtype=np.float64)
        picks = rng.choice(len(names), size=batch_size, p=weights / weights.sum())
        rows = []
        for pick in picks:
            array = self.arrays[(names[pick], "train")]
            start = int(rng.integers(0, len(array) - seq_len))
            rows.append(array[start:start + seq_len].astype(np.int64))
        return torch.from_numpy(np.stack(rows))

    def heldout_windows(self, workload: str, seq_len: int, count: int) -> torch.Tensor:
        """``count`` evenly spaced held-out windows ``[count, seq_len]`` (deterministic)."""
        array = self.arrays[(workload, "heldout")]
        starts = np.linspace(0, len(array) - seq_len - 1, count).astype(np.int64)
        return torch.from_numpy(np.stack([array[s:s + seq_len].astype(np.int64) for s in starts]))


# ---------------------------------------------------------------------------------------------- model
def build_llama(spec: ArchitectureSpec, tokenizer, seed: int):
    """A freshly initialised ``LlamaForCausalLM`` with tied embeddings, seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0, attention_bias=False, **spec.model_dump())
    return LlamaForCausalLM(config)


def _lr_at(stage: StageSpec, step: int) -> float:
    if step < stage.warmup_steps:
        return stage.learning_rate * (step + 1) / stage.warmup_steps
    progress = (step - stage.warmup_steps) / max(1, stage.steps - stage.warmup_steps)
    return stage.learning_rate * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def train_stage(name: str, model, stage: StageSpec, streams: TokenStreams, mixture: dict[str, float],
                work_dir: Path, seed: int, checkpoint_every: int, teacher=None) -> float:
    """Run one stage with checkpoints/resume; with ``teacher``, the loss is
    ``kl_weight · KL(teacher ‖ model) + (1 − kl_weight) · CE``. Returns the stage's total training
    seconds over all runs (as recorded in its checkpoint)."""
    ckpt_path = work_dir / f"{name}.ckpt"
    optimizer = torch.optim.AdamW(model.parameters(), lr=stage.learning_rate, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    start_step, rng_state, seconds_before = 0, None, 0.0
    if ckpt_path.exists():
        saved = torch.load(ckpt_path, weights_only=False)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start_step, rng_state = saved["step"], saved["rng"]
        seconds_before = saved.get("seconds", 0.0)
    if start_step >= stage.steps:
        return seconds_before
    rng = np.random.default_rng(seed)
    if rng_state is not None:
        rng.bit_generator.state = rng_state
    model.train()
    tokens_per_step = stage.batch_size * stage.seq_len
    bar = tqdm(total=stage.steps, initial=start_step, desc=name, unit="step", dynamic_ncols=True)
    started, ema_loss = time.perf_counter(), None
    for step in range(start_step, stage.steps):
        batch = streams.sample(rng, mixture, stage.batch_size, stage.seq_len)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(stage, step)
        logits = model(input_ids=batch).logits[:, :-1]  # [batch, seq_len - 1, vocab]
        labels = batch[:, 1:]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        if teacher is not None and stage.kl_weight > 0:
            with torch.no_grad():
                teacher_logits = teacher(input_ids=batch).logits[:, :-1]
            temperature = stage.distill_temperature
            kl = F.kl_div(F.log_softmax(logits / temperature, -1).reshape(-1, logits.shape[-1]),
                          F.log_softmax(teacher_logits / temperature, -1).reshape(-1, logits.shape[-1]),
                          log_target=True, reduction="batchmean") * temperature**2
            loss = stage.kl_weight * kl + (1 - stage.kl_weight) * loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        ema_loss = loss.item() if ema_loss is None else 0.98 * ema_loss + 0.02 * loss.item()
        done = step + 1 - start_step
        bar.set_postfix(loss=f"{ema_loss:.3f}",
                        tok_s=f"{done * tokens_per_step / (time.perf_counter() - started):.0f}")
        bar.update(1)
        if (step + 1) % checkpoint_every == 0 or step + 1 == stage.steps:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step + 1, "rng": rng.bit_generator.state,
                        "seconds": seconds_before + time.perf_counter() - started}, ckpt_path)
    bar.close()
    return seconds_before + time.perf_counter() - started


@torch.no_grad()
def heldout_loss(model, streams: TokenStreams, seq_len: int = 256, count: int = 32) -> dict[str, float]:
    """Mean next-token cross-entropy (nats) on fixed held-out windows, per workload."""
    model.eval()
    losses = {}
    for workload in WORKLOADS:
        batch = streams.heldout_windows(workload, seq_len, count)
        logits = model(input_ids=batch).logits[:, :-1]
        losses[workload] = F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           batch[:, 1:].reshape(-1)).item()
    return losses


def train_demo_pair(corpus_dir: Path, work_dir: Path, out_dir: Path, config: DemoTrainConfig) -> dict:
    """Run every stage (resuming where checkpoints exist) and write ``out_dir/{target,draft,tokenizer}``.

    Returns a report (parameter counts, held-out losses, wall time per stage) also written to
    ``out_dir/training_report.json``.
    """
    from transformers import AutoTokenizer

    torch.set_num_threads(config.threads)
    random.seed(config.seed)
    work_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = work_dir / "tokenizer"
    if not (tokenizer_dir / "tokenizer.json").exists():
        texts = []
        for workload in WORKLOADS:
            text = (corpus_dir / workload / "train.txt").read_text(encoding="utf-8")
            texts.extend(read_documents_from_text(text[: config.tokenizer_bytes_per_workload]))
        train_tokenizer(texts, config.vocab_size, tokenizer_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert tokenizer.eos_token == EOS_TOKEN
    streams = TokenStreams(corpus_dir, tokenizer, work_dir / "tokens")

    report: dict = {"config": config.model_dump(), "stages": {}}
    target = build_llama(config.target, tokenizer, config.seed)
    seconds = train_stage("target", target, config.target_stage, streams, config.mixture, work_dir, config.seed,
                          config.checkpoint_every)
    report["stages"]["target"] = {"seconds": seconds}
    target.eval()
    for parameter in target.parameters():
        parameter.requires_grad_(False)

    draft = build_llama(config.draft, tokenizer, config.seed + 1)
    seconds = train_stage("draft", draft, config.draft_stage, streams, config.mixture, work_dir, config.seed + 1,
                          config.checkpoint_every)
    report["stages"]["draft"] = {"seconds": seconds}
    seconds = train_stage("distill", draft, config.distill_stage, streams, config.mixture, work_dir,
                          config.seed + 2, config.checkpoint_every, teacher=target)
    report["stages"]["distill"] = {"seconds": seconds}

    for role, model in (("target", target), ("draft", draft)):
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.save_pretrained(str(out_dir / role), safe_serialization=True)
        tokenizer.save_pretrained(str(out_dir / role))
        report[role] = {"parameters": sum(p.numel() for p in model.parameters()),
                        "heldout_loss_nats": heldout_loss(model, streams)}
    tokenizer.save_pretrained(str(out_dir / "tokenizer"))
    (out_dir / "training_report.json").write_text(json.dumps(report, indent=2))
    return report


def read_documents_from_text(text: str) -> list[str]:
    """Split already-read corpus text into documents (see ``corpus.DOC_SEPARATOR``)."""
    from raysd.demo.corpus import DOC_SEPARATOR

    return [doc for doc in text.split(DOC_SEPARATOR) if doc]
