"""``raysd`` command line: serve, fingerprint, generate, probe, demo (corpus / train / prompts / run)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from raysd.models import DEMO_DIR, DEMO_DRAFT, DEMO_TARGET, REPO_ROOT

DEFAULT_PROMPTS = REPO_ROOT / "bench" / "prompts" / "heldout.jsonl"


def _read_prompts(path: Path) -> list[dict]:
    records = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise SystemExit(f"{path}:{number}: not JSON ({error.msg}); each line must be "
                             '{"prompt": "...", "workload": "..."}') from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str) or not record["prompt"]:
            raise SystemExit(f'{path}:{number}: needs a non-empty string "prompt"')
        records.append(record)
    if not records:
        raise SystemExit(f"{path}: no prompts")
    return records


def _build_engine(args, tokenizer_and_models):
    from raysd.config import DrafterConfig, DrafterKind, EngineConfig, PolicyConfig, SpeculationMode
    from raysd.drafting import ModelDrafter, NgramDrafter
    from raysd.engine import SpecEngine

    pair = tokenizer_and_models
    mode = SpeculationMode(args.speculation)
    k = args.k if args.k is not None else 4
    policy = PolicyConfig(mode=mode, k=k, k_max=max(k, args.k_max))
    engine_config = EngineConfig(max_num_seqs=args.batch_size, max_model_len=args.max_model_len)
    drafter = None
    if mode != SpeculationMode.off:
        if DrafterKind(args.drafter) == DrafterKind.ngram:
            drafter = NgramDrafter(DrafterConfig(kind=DrafterKind.ngram), len(pair.tokenizer))
        else:
            drafter = ModelDrafter(pair.draft, engine_config.max_num_seqs, engine_config.max_model_len,
                                   policy.k_max)
    return SpecEngine(pair.target, drafter, pair.tokenizer.eos_token_id, engine_config, policy)


def cmd_generate(args) -> int:
    import torch

    from raysd.config import SamplingParams
    from raysd.models import ModelPair

    torch.set_num_threads(args.threads)
    records = _read_prompts(args.prompts)
    needs_draft = args.speculation != "off" and args.drafter == "model"
    pair = ModelPair(args.target, args.draft if needs_draft else None)
    engine = _build_engine(args, pair)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed, ignore_eos=args.ignore_eos)
    prompt_ids = [pair.tokenizer.encode(r["prompt"]) for r in records]
    sequences = [engine.add(ids, params, r.get("workload") or "default") for ids, r in zip(prompt_ids, records)]
    engine.run_to_completion()
    for record, sequence in zip(records, sequences):
        result = {
            "workload": record.get("workload"),
            "prompt_token_ids": sequence.prompt_token_ids,
            "token_ids": sequence.output_token_ids,
            "text": pair.tokenizer.decode(sequence.output_token_ids),
            "finish_reason": sequence.finish_reason,
            "rounds": sequence.stats.rounds,
            "drafted_tokens": sequence.stats.drafted_tokens,
            "accepted_tokens": sequence.stats.accepted_tokens,
            "acceptance_rate": sequence.stats.acceptance_rate,
            "decode_seconds": (sequence.finished_at or 0) - (sequence.admitted_at or 0),
        }
        if args.json:
            print(json.dumps(result))
        else:
            print(f"--- [{result['workload']}] {record['prompt'][:60]!r}")
            print(result["text"])
            print(f"    rounds={result['rounds']} drafted={result['drafted_tokens']} "
                  f"accepted={result['accepted_tokens']} seconds={result['decode_seconds']:.2f}")
    return 0


def cmd_probe(args) -> int:
    import torch

    from raysd.models import ModelPair
    from raysd.probe import format_report, probe

    torch.set_num_threads(args.threads)
    pair = ModelPair(args.target, args.draft)
    report = probe(pair, _read_prompts(args.prompts), k_max=args.k_max, max_tokens=args.max_tokens,
                   progress=not args.json)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def cmd_demo_corpus(args) -> int:
    from raysd.demo.corpus import build_corpora

    stats = build_corpora(Path(args.out), seed=args.seed)
    print(json.dumps(stats, indent=2))
    return 0


def cmd_demo_train(args) -> int:
    from raysd.demo.train import DemoTrainConfig, train_demo_pair

    config = DemoTrainConfig.model_validate_json(Path(args.config).read_text()) if args.config \
        else DemoTrainConfig()
    report = train_demo_pair(Path(args.corpus), Path(args.work_dir), Path(args.out), config)
    print(json.dumps({role: report[role] for role in ("target", "draft")}, indent=2))
    return 0


def cmd_demo_prompts(args) -> int:
    from raysd.demo.prompts import write_prompt_file

    count = write_prompt_file(Path(args.corpus), Path(args.out), args.per_workload, args.prompt_chars, args.seed)
    print(f"wrote {count} prompts to {args.out}")
    return 0


def cmd_demo_run(args) -> int:
    from raysd.demo.run import run_demo

    results = run_demo(args.target, args.draft, _read_prompts(args.prompts), args.per_workload, args.max_tokens,
                       args.threads)
    return 0 if all(figures["identical"] for figures in results.values()) else 1


def cmd_serve(args) -> int:
    import signal
    import threading

    from raysd.serve.app import default_local_config_path, start_local
    from raysd.serve.config import ServerConfig

    config_path = args.config or default_local_config_path()
    config = ServerConfig.from_file(config_path) if config_path.exists() else ServerConfig()
    config = config.model_copy(update={"host": args.host or config.host, "port": args.port or config.port})
    api_key = args.api_key or os.environ.get("RAYSD_API_KEY")
    if api_key:
        from pydantic import SecretStr

        config = config.model_copy(update={"router": config.router.model_copy(update={"api_key": SecretStr(api_key)})})
    if args.dry_run:
        from raysd.serve.app import resource_demand
        from raysd.serve.placement import resolve_deployments

        print(json.dumps({"config": str(config_path), "deployments": resolve_deployments(config),
                          "total_resources": resource_demand(config)}, indent=2, default=str))
        return 0
    print(f"raysd: starting a local Ray and deploying {config_path} (first start takes a minute)…", flush=True)
    import ray
    from ray import serve

    try:  # Ctrl-C while starting raises KeyboardInterrupt; once serving, the handlers below end the wait
        url = start_local(config)
        alias = config.router.model_alias
        auth = " -H 'Authorization: Bearer $RAYSD_API_KEY'" if config.router.api_key else ""
        print(f"\nraysd is serving {alias!r} at {url}  (OpenAI-compatible; Ctrl-C stops it)\n\n"
              f"  curl {url}/v1/completions -H 'Content-Type: application/json'{auth} \\\n"
              f"    -d '{{\"model\": \"{alias}\", \"prompt\": \"def fibonacci(n):\", \"max_tokens\": 48, "
              f"\"temperature\": 0}}'\n", flush=True)
        stopped = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stopped.set())
        signal.signal(signal.SIGTERM, lambda *_: stopped.set())
        stopped.wait()
    except KeyboardInterrupt:
        pass
    finally:
        print("raysd: shutting down", flush=True)
        serve.shutdown()
        ray.shutdown()
    return 0


def cmd_fingerprint(args) -> int:
    from tqdm import tqdm

    from raysd.fingerprint import analyse, plot, record_stream

    if args.n < 1 or args.max_tokens < 2:
        raise ValueError("--n must be ≥ 1 and --max-tokens ≥ 2 (gaps need two chunks)")
    headers = {}
    for header in args.header:
        name, sep, value = header.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--header {header!r}: expected 'Name: value'")
        headers[name.strip()] = value.strip()
    streams = [record_stream(args.url, args.model, args.prompt, args.max_tokens, args.api_key, headers=headers)
               for _ in tqdm(range(args.n), desc="streams", disable=args.json)]
    result = analyse(streams)
    if args.plot:
        plot(result, args.plot, f"{args.url} ({args.model})")
    if args.json:
        print(json.dumps(result.summary()))
    else:
        summary = result.summary()
        print(f"{args.url}: {summary.pop('verdict')}")
        for name, value in summary.items():
            print(f"  {name:18s} {value:.3f}" if isinstance(value, float) else f"  {name:18s} {value}")
        if args.plot:
            print(f"  gap histogram: {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="raysd", description="Speculative decoding that knows when it pays.")
    commands = parser.add_subparsers(dest="command", required=True)

    def model_args(sub):
        sub.add_argument("--target", type=Path, default=DEMO_TARGET, help="target model directory")
        sub.add_argument("--draft", type=Path, default=DEMO_DRAFT, help="draft model directory")
        sub.add_argument("--threads", type=int, default=2, help="torch threads")

    serve_cmd = commands.add_parser("serve", help="start a local Ray Serve app with the OpenAI API")
    serve_cmd.add_argument("--config", type=Path, default=None, help="ServerConfig YAML (deployments/local.yaml)")
    serve_cmd.add_argument("--host", default=None, help="bind address (default 127.0.0.1)")
    serve_cmd.add_argument("--port", type=int, default=None, help="port (default 8000)")
    serve_cmd.add_argument("--api-key", default=None,
                           help="require 'Authorization: Bearer KEY' on every route but /health (or set RAYSD_API_KEY)")
    serve_cmd.add_argument("--dry-run", action="store_true",
                           help="validate the config and print the resolved placement (replicas, bundles, "
                                "resources) as JSON; starts nothing")
    serve_cmd.set_defaults(func=cmd_serve)

    fingerprint = commands.add_parser("fingerprint", help="tell from the stream's pacing whether an OpenAI-"
                                                          "compatible endpoint speculates")
    fingerprint.add_argument("--url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    fingerprint.add_argument("--model", default="raysd-demo")
    fingerprint.add_argument("--prompt", default='{"order_id": "ord_1234567", "items": [')
    fingerprint.add_argument("--n", type=int, default=3, help="streams to record")
    fingerprint.add_argument("--max-tokens", type=int, default=64)
    fingerprint.add_argument("--api-key", default=None, help="sent as a Bearer token")
    fingerprint.add_argument("--header", action="append", default=[],
                             help="extra request header 'Name: value' (repeatable), e.g. 'X-Raysd-Workload: json'")
    fingerprint.add_argument("--plot", type=Path, default=None, help="write a PNG of the gap distribution")
    fingerprint.add_argument("--json", action="store_true")
    fingerprint.set_defaults(func=cmd_fingerprint)

    generate = commands.add_parser("generate", help="decode prompts from a JSONL file")
    generate.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    model_args(generate)
    generate.add_argument("--speculation", choices=["off", "on", "adaptive"], default="adaptive")
    generate.add_argument("--drafter", choices=["model", "ngram"], default="model")
    generate.add_argument("--k", type=int, default=None, help="draft length for --speculation on (default 4)")
    generate.add_argument("--k-max", type=int, default=8)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--max-model-len", type=int, default=1024)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--ignore-eos", action="store_true")
    generate.add_argument("--batch-size", type=int, default=16)
    generate.add_argument("--json", action="store_true", help="one JSON object per prompt")
    generate.set_defaults(func=cmd_generate)

    probe = commands.add_parser("probe", help="measure acceptance per workload and k, costs, predicted speedup")
    probe.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    model_args(probe)
    probe.add_argument("--k-max", type=int, default=8)
    probe.add_argument("--max-tokens", type=int, default=64)
    probe.add_argument("--output", type=Path, default=None, help="also write the JSON report here")
    probe.add_argument("--json", action="store_true")
    probe.set_defaults(func=cmd_probe)

    demo = commands.add_parser("demo", help="build and train the demo model pair").add_subparsers(
        dest="demo_command", required=True)
    corpus = demo.add_parser("corpus", help="build the offline code/json/prose corpora")
    corpus.add_argument("--out", type=Path, default=REPO_ROOT / "data" / "corpus")
    corpus.add_argument("--seed", type=int, default=0)
    corpus.set_defaults(func=cmd_demo_corpus)
    train = demo.add_parser("train", help="train tokenizer, target and distilled draft (resumable)")
    train.add_argument("--corpus", type=Path, default=REPO_ROOT / "data" / "corpus")
    train.add_argument("--work-dir", type=Path, default=REPO_ROOT / "data" / "train")
    train.add_argument("--out", type=Path, default=DEMO_DIR)
    train.add_argument("--config", type=Path, default=None, help="DemoTrainConfig as JSON (defaults: shipped)")
    train.set_defaults(func=cmd_demo_train)
    prompts = demo.add_parser("prompts", help="write held-out prompts (JSONL) for generate/probe/bench")
    prompts.add_argument("--corpus", type=Path, default=REPO_ROOT / "data" / "corpus")
    prompts.add_argument("--out", type=Path, default=DEFAULT_PROMPTS)
    prompts.add_argument("--per-workload", type=int, default=16)
    prompts.add_argument("--prompt-chars", type=int, default=160)
    prompts.add_argument("--seed", type=int, default=0)
    prompts.set_defaults(func=cmd_demo_prompts)
    run = demo.add_parser("run", help="decode held-out prompts with speculation off vs adaptive")
    run.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    model_args(run)
    run.add_argument("--per-workload", type=int, default=4)
    run.add_argument("--max-tokens", type=int, default=64)
    run.set_defaults(func=cmd_demo_run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as error:  # user mistakes carry their fix in the message
        print(f"raysd: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
