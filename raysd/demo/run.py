"""`raysd demo run`: the demo pair on held-out prompts, speculation off vs adaptive, per workload."""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from raysd.config import EngineConfig, PolicyConfig, SamplingParams, SpeculationMode
from raysd.drafting import ModelDrafter
from raysd.engine import SpecEngine
from raysd.models import ModelPair


def run_demo(target_dir: Path, draft_dir: Path, prompts: list[dict], per_workload: int = 4,
             max_tokens: int = 64, threads: int = 2) -> dict:
    """Decode each workload's first ``per_workload`` prompts both ways; return figures per workload."""
    torch.set_num_threads(threads)
    console = Console()
    console.print(f"loading target [bold]{target_dir}[/] and draft [bold]{draft_dir}[/]")
    pair = ModelPair(target_dir, draft_dir)
    by_workload: dict[str, list[list[int]]] = defaultdict(list)
    for record in prompts:
        workload = record.get("workload") or "default"
        if len(by_workload[workload]) < per_workload:
            by_workload[workload].append(pair.tokenizer.encode(record["prompt"]))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine_config = EngineConfig(max_num_seqs=per_workload, max_model_len=1024)
    results = {}
    with console.status("decoding") as status:
        for workload, prompt_ids in sorted(by_workload.items()):
            figures = {}
            for mode in (SpeculationMode.off, SpeculationMode.adaptive):
                status.update(f"{workload}: speculation {mode.value}")
                drafter = None if mode == SpeculationMode.off else ModelDrafter(
                    pair.draft, engine_config.max_num_seqs, engine_config.max_model_len)
                engine = SpecEngine(pair.target, drafter, pair.tokenizer.eos_token_id, engine_config,
                                    PolicyConfig(mode=mode))
                started = time.perf_counter()
                sequences = engine.generate(prompt_ids, params, [workload] * len(prompt_ids))
                seconds = time.perf_counter() - started
                totals = engine.aggregator.segments.get(workload)
                figures[mode.value] = {
                    "tokens_per_second": sum(s.num_generated for s in sequences) / seconds,
                    "acceptance_rate": totals.acceptance_rate if totals else None,
                    "outputs": [s.output_token_ids for s in sequences],
                }
            figures["identical"] = figures["off"]["outputs"] == figures["adaptive"]["outputs"]
            figures["sample"] = pair.tokenizer.decode(prompt_ids[0] + figures["adaptive"]["outputs"][0])
            results[workload] = figures

    table = Table(title="raysd demo: greedy decoding of held-out prompts (batch of "
                        f"{per_workload}, {max_tokens} tokens each)")
    for column in ("workload", "acceptance", "tok/s off", "tok/s adaptive", "speedup", "identical"):
        table.add_column(column)
    for workload, figures in results.items():
        rate = figures["adaptive"]["acceptance_rate"]
        off, on = figures["off"]["tokens_per_second"], figures["adaptive"]["tokens_per_second"]
        table.add_row(workload, f"{rate:.2f}" if rate is not None else "-", f"{off:.0f}", f"{on:.0f}",
                      f"{on / off:.2f}x", "yes" if figures["identical"] else "[red]NO[/]")
    console.print(table)
    for workload, figures in results.items():
        console.rule(f"{workload} sample (prompt + continuation)")
        console.print(figures["sample"], markup=False, highlight=False)
    return results
