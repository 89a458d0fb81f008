"""Prompts cut from the held-out corpora: what `generate`, `probe` and the benchmarks run on."""

from __future__ import annotations

import json
import random
from pathlib import Path

from raysd.demo.corpus import WORKLOADS, read_documents


def cut_prompt(document: str, rng: random.Random, prompt_chars: int) -> str | None:
    """A prompt of about ``prompt_chars`` characters starting at a line start, ending after whitespace."""
    line_starts = [0] + [i + 1 for i, ch in enumerate(document) if ch == "\n" and i + 1 < len(document)]
    candidates = [s for s in line_starts if len(document) - s > prompt_chars * 2 and document[s:s + 1].strip()]
    if not candidates:
        return None
    start = rng.choice(candidates[: max(1, len(candidates) // 2)])
    text = document[start:start + prompt_chars]
    cut = max(text.rfind(" "), text.rfind("\n"))
    return text[: cut + 1] if cut > prompt_chars // 2 else text


def heldout_prompts(corpus_dir: Path, per_workload: int, prompt_chars: int, seed: int = 0) -> list[dict]:
    """``per_workload`` prompts from each workload's held-out split, deterministic for a seed."""
    records = []
    for workload in WORKLOADS:
        rng = random.Random(f"{seed}-{workload}")
        documents = read_documents(Path(corpus_dir) / workload / "heldout.txt")
        rng.shuffle(documents)
        chosen = []
        for document in documents:
            prompt = cut_prompt(document, rng, prompt_chars)
            if prompt:
                chosen.append({"prompt": prompt, "workload": workload})
            if len(chosen) == per_workload:
                break
        records.extend(chosen)
    return records


def write_prompt_file(corpus_dir: Path, out: Path, per_workload: int, prompt_chars: int, seed: int = 0) -> int:
    records = heldout_prompts(corpus_dir, per_workload, prompt_chars, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return len(records)
