"""Distributed path vs in-process engine: tokens/s at batch 1 and 16, and the Ray overhead per round.

Both sides decode the same held-out prompts with the demo pair, greedy, ``ignore_eos``, fixed k (speculation
"on", so both run the same rounds), one torch thread per model. In-process = ``SpecEngine`` in this process
(before Ray starts). Distributed = the real Serve app over HTTP (router → draft actor → target rank actor),
batch 1 = one request at a time, batch 16 = 16 concurrent streaming-free requests. The router's
``/health`` gives the round timing; overhead per round = round wall time − time the model work took in
the actors (draft + prefill + verify), i.e. the scheduling and the remote-call hops.

    python bench/bench_serve.py            # writes bench/results/serve.json and docs/bench_serve.md
    python bench/bench_serve.py --quick    # fewer prompts / tokens (smoke run)
    python bench/bench_serve.py --tracing  # tracing on vs off (same cluster, interleaved) → serve_tracing.json
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKLOADS = ("code", "json", "prose")
PORT = 8131


def _prompts(workload: str, count: int) -> list[str]:
    records = [json.loads(line) for line in (REPO / "bench/prompts/heldout.jsonl").read_text().splitlines()]
    chosen = [r["prompt"] for r in records if r["workload"] == workload]
    return (chosen * (count // len(chosen) + 1))[:count]


def in_process(workload: str, batch: int, count: int, max_tokens: int, k: int) -> dict:
    """Tokens/s and round timing of ``SpecEngine`` on ``count`` prompts, ``batch`` at a time."""
    from raysd.config import EngineConfig, PolicyConfig, SamplingParams, SpeculationMode
    from raysd.drafting import ModelDrafter
    from raysd.engine import SpecEngine
    from raysd.models import DEMO_DRAFT, DEMO_TARGET, ModelPair

    pair = ModelPair(DEMO_TARGET, DEMO_DRAFT)
    prompts = [pair.tokenizer.encode(p) for p in _prompts(workload, count)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine = SpecEngine(pair.target, ModelDrafter(pair.draft, batch, 1024, k), pair.tokenizer.eos_token_id,
                        EngineConfig(max_num_seqs=batch, max_model_len=1024, threads=1),
                        PolicyConfig(mode=SpeculationMode.on, k=k))
    engine.generate(prompts[:1], params)  # warm-up
    engine.aggregator.__init__()
    started = time.perf_counter()
    outputs = []
    for start in range(0, len(prompts), batch):
        outputs += [s.output_token_ids for s in engine.generate(prompts[start:start + batch], params)]
    seconds = time.perf_counter() - started
    return {"tokens_per_second": sum(map(len, outputs)) / seconds, "timing": engine.aggregator.timing(),
            "outputs": outputs}


def distributed(url: str, workload: str, batch: int, count: int, max_tokens: int) -> dict:
    """The same over HTTP; ``batch`` requests in flight at once."""
    import requests

    def complete(prompt: str) -> list[int]:
        response = requests.post(f"{url}/v1/completions", timeout=600, json={
            "model": "raysd-demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True, "metadata": {"workload": workload}})
        response.raise_for_status()
        return response.json()["choices"][0]["token_ids"]

    prompts = _prompts(workload, count)
    complete(prompts[0])  # warm-up
    before = requests.get(f"{url}/health", timeout=30).json()["round_timing"]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=batch) as pool:
        outputs = list(pool.map(complete, prompts))
    seconds = time.perf_counter() - started
    after = requests.get(f"{url}/health", timeout=30).json()["round_timing"]
    rounds = after["rounds"] - before["rounds"]
    round_s = after["round_seconds"] - before["round_seconds"]
    model_s = after["model_seconds"] - before["model_seconds"]
    timing = {"rounds": rounds, "mean_round_ms": 1000 * round_s / rounds, "mean_model_ms": 1000 * model_s / rounds,
              "mean_overhead_ms": 1000 * (round_s - model_s) / rounds}
    return {"tokens_per_second": sum(map(len, outputs)) / seconds, "timing": timing, "outputs": outputs}


def _discarding_otlp_receiver() -> str:
    """A local OTLP/HTTP endpoint that accepts and drops spans (the exporters do their full work)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def tracing_overhead(config, url: str, k: int, repeats: int, max_tokens: int) -> dict:
    """Tokens/s of the same app with tracing off (``url``) and on (``url``/traced), interleaved."""
    from ray import serve

    from raysd.serve.app import build_app

    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": _discarding_otlp_receiver(), "OTEL_SERVICE_NAME": "raysd-bench"}
    serve.run(build_app(config, telemetry_env=env), name="raysd-traced", route_prefix="/traced")
    results: dict = {}
    for batch in (1, 16):
        figures: dict[str, list[float]] = {"off": [], "on": []}
        for _ in range(repeats):
            for mode, base in (("off", url), ("on", f"{url}/traced")):
                figures[mode].append(distributed(base, "json", batch, 4 if batch == 1 else 16,
                                                 max_tokens)["tokens_per_second"])
        median = {mode: sorted(values)[len(values) // 2] for mode, values in figures.items()}
        results[f"json@{batch}"] = {"runs": figures, "median": median, "on_over_off": median["on"] / median["off"]}
    return results


def _table(summary: dict) -> str:
    lines = ["| workload@batch | in-process tok/s | distributed tok/s | ratio | in-process round ms | "
             "distributed round ms | model work ms (dist.) | overhead ms/round (dist.) | identical |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, row in summary.items():
        local, remote = row["in_process"], row["distributed"]
        lines.append(f"| {key} | {local['tokens_per_second']:.0f} | {remote['tokens_per_second']:.0f} | "
                     f"{row['ratio']:.2f} | {local['timing']['mean_round_ms']:.1f} | "
                     f"{remote['timing']['mean_round_ms']:.1f} | {remote['timing']['mean_model_ms']:.1f} | "
                     f"{remote['timing']['mean_overhead_ms']:.1f} | {'yes' if row['identical'] else 'NO'} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tracing", action="store_true", help="measure tracing on vs off instead")
    parser.add_argument("--out", type=Path, default=REPO / "bench/results/serve.json")
    parser.add_argument("--doc", type=Path, default=REPO / "docs/bench_serve.md")
    args = parser.parse_args()
    count_b1, count_b16, max_tokens = (2, 16, 16) if args.quick else (4, 16, 64)

    import torch
    from tqdm import tqdm

    torch.set_num_threads(1)
    runs = [(w, b) for w in WORKLOADS for b in (1, 16)]
    local = {} if args.tracing else {(w, b): in_process(w, b, count_b1 if b == 1 else count_b16, max_tokens, args.k)
                                     for w, b in tqdm(runs, desc="in-process")}

    from ray import serve

    from raysd.models import DEMO_DRAFT, DEMO_TARGET
    from raysd.serve.app import start_local
    from raysd.serve.config import ServerConfig

    config = ServerConfig.model_validate({
        "port": PORT,
        "target": {"model_dir": str(DEMO_TARGET), "placement": {"resources": {"target_device": 1}}},
        "draft": {"model_dir": str(DEMO_DRAFT), "k_max": args.k, "placement": {"resources": {"draft_device": 1}}},
        "router": {"engine": {"max_model_len": 1024, "max_num_seqs": 16}, "policy": {"mode": "on", "k": args.k}},
    })
    url = start_local(config, num_cpus=2)
    if args.tracing:
        try:
            results = tracing_overhead(config, url, args.k, 1 if args.quick else 3, max_tokens)
        finally:
            serve.shutdown()
        (REPO / "bench/results/serve_tracing.json").write_text(json.dumps(results, indent=2) + "\n")
        for key, row in results.items():
            print(f"{key}: tracing on / off = {row['on_over_off']:.3f}  (median tok/s {row['median']})")
        return 0
    try:
        remote = {(w, b): distributed(url, w, b, count_b1 if b == 1 else count_b16, max_tokens)
                  for w, b in tqdm(runs, desc="distributed")}
    finally:
        serve.shutdown()
    summary = {}
    for workload, batch in runs:
        mine, theirs = local[(workload, batch)], remote[(workload, batch)]
        summary[f"{workload}@{batch}"] = {
            "in_process": {k: v for k, v in mine.items() if k != "outputs"},
            "distributed": {k: v for k, v in theirs.items() if k != "outputs"},
            "ratio": theirs["tokens_per_second"] / mine["tokens_per_second"],
            "identical": mine["outputs"] == theirs["outputs"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"k": args.k, "max_tokens": max_tokens, "quick": args.quick,
                                    "summary": summary}, indent=2) + "\n")
    table = _table(summary)
    print(table)
    if not args.quick:
        doc = args.doc.read_text() if args.doc.exists() else ""
        marker = "<!-- results -->"
        head, _, tail = doc.partition(marker)
        tail = tail.split("<!-- /results -->", 1)[-1] if tail else ""
        args.doc.write_text(f"{head}{marker}\n{table}\n<!-- /results -->{tail}" if doc else
                            f"# Serving benchmark\n\n{marker}\n{table}\n<!-- /results -->\n")
    return 0 if all(row["identical"] for row in summary.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
