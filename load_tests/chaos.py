"""Chaos run: under Locust load, kill a draft replica, then a target rank, then the router replica, then
roll out a changed config (every replica replaced gracefully).

The script is the Ray driver: it starts the app (deployments/local.yaml's settings) on an embedded Ray,
runs Locust as its own process (greedy code + JSON users, token ids recorded), and at fixed times kills
the draft worker's replica (its draft actor dies with it), the target group's rank actor, and the router
replica — with ``ray.kill``, as a crash would — and finally redeploys the app with one router setting
changed (a rolling update: in-flight streams should finish on the draining old replicas). Afterwards it
shuts Ray down, decodes every distinct prompt with the target alone (in-process, speculation off) and
reports:

- requests sent / completed / failed / hung (a request is hung if no byte came for RAYSD_REQUEST_TIMEOUT);
- failures by phase (after which fault), and whether any completed output differs from the target-only one.

    python load_tests/chaos.py                       # ~3 min; writes bench/results/chaos.json
    python load_tests/chaos.py --quick               # shorter phases
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"


def _kill_draft_replica() -> str:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "::raysd#DraftWorker#" in a["name"]]
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=False)
    return names[0]


def _kill_target_rank() -> str:
    import ray
    from ray import serve

    view = serve.get_deployment_handle("ClusterMonitor", app_name="raysd").view.remote().result()
    group = next(w for w in view.workers.values() if w.kind == "target")
    ray.kill(group.actors[-1])
    return f"{group.worker_id} rank {len(group.actors) - 1}"


def _kill_router() -> str:
    import ray

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "::raysd#Router#" in a["name"]]
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=False)
    return names[0]


def _redeploy() -> str:
    """Roll out a changed config (Serve replaces every replica: the app's args changed), in the background
    as an operator's ``serve deploy`` would; in-flight streams should finish on the old replicas."""
    import threading

    from ray import serve

    from raysd.serve.app import APP_NAME, build_app

    config = _server_config()
    changed = config.model_copy(update={"router": config.router.model_copy(
        update={"max_waiting": config.router.max_waiting + 1})})
    threading.Thread(target=serve.run, args=(build_app(changed),), kwargs={"name": APP_NAME, "route_prefix": "/"},
                     daemon=True).start()
    return f"{APP_NAME}: router.max_waiting {config.router.max_waiting} → {changed.router.max_waiting}"


def _server_config():
    from raysd.serve.config import ServerConfig

    config = ServerConfig.from_file(REPO / "deployments" / "local.yaml")
    return config.model_copy(update={"port": 8141})


FAULTS = (("draft replica killed", _kill_draft_replica), ("target rank killed", _kill_target_rank),
          ("router replica killed", _kill_router), ("config redeployed", _redeploy))


def target_only(outputs: list[dict], max_tokens: int) -> dict[str, list[int]]:
    """Greedy target-only continuations of each distinct prompt (speculation off, same stop rules)."""
    from raysd.config import EngineConfig, PolicyConfig, SamplingParams, SpeculationMode
    from raysd.engine import SpecEngine
    from raysd.models import DEMO_TARGET, ModelPair

    pair = ModelPair(DEMO_TARGET, None)
    prompts = sorted({o["prompt"] for o in outputs})
    engine = SpecEngine(pair.target, None, pair.tokenizer.eos_token_id, EngineConfig(max_num_seqs=16),
                        PolicyConfig(mode=SpeculationMode.off))
    sequences = engine.generate([pair.tokenizer.encode(p) for p in prompts], SamplingParams(max_tokens=max_tokens))
    return {prompt: s.output_token_ids for prompt, s in zip(prompts, sequences)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "chaos.json")
    args = parser.parse_args(argv)
    phase_s = 12 if args.quick else 25

    from raysd.serve.app import start_local

    url = start_local(_server_config(), num_cpus=2)
    with tempfile.TemporaryDirectory() as scratch:
        dump = Path(scratch) / "raw.json"
        env = {**os.environ, "RAYSD_LOCUST_DUMP": str(dump), "RAYSD_MAX_TOKENS": str(args.max_tokens),
               "RAYSD_RECORD_OUTPUTS": "1", "RAYSD_REQUEST_TIMEOUT": "60"}
        duration = phase_s * (len(FAULTS) + 1)
        locust = subprocess.Popen(
            [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "CodeUser", "JsonUser", "--headless",
             "-u", str(args.users), "-r", str(args.users), "-t", f"{duration}s", "--stop-timeout", "90",
             "--host", url, "--only-summary", "--loglevel", "WARNING"], env=env, cwd=REPO,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        started, wall_start = time.monotonic(), time.time()
        timeline = []
        for index, (label, fault) in enumerate(FAULTS, start=1):
            time.sleep(max(0.0, started + index * phase_s - time.monotonic()))
            timeline.append({"at_s": round(time.monotonic() - started, 1), "fault": label, "victim": fault()})
            print(f"[{timeline[-1]['at_s']:6.1f}s] {label}: {timeline[-1]['victim']}", flush=True)
        locust.wait(timeout=duration + 240)
        raw = json.loads(dump.read_text())
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()
    outputs = [o for workload in raw.values() for o in workload["outputs"]]
    failures = [reason for workload in raw.values() for reason in workload["failure_reasons"]]
    phases = ["before faults"] + [f"after {f['fault']}" for f in timeline]
    by_phase = dict.fromkeys(phases, 0)
    for workload in raw.values():
        for at in workload["failure_at"]:
            elapsed = at - wall_start
            by_phase[phases[sum(elapsed >= f["at_s"] for f in timeline)]] += 1
    references = target_only(outputs, args.max_tokens)
    mismatched = [o for o in outputs if o["token_ids"] != references[o["prompt"]]]
    report = {
        "users": args.users, "phase_s": phase_s, "faults": timeline,
        "sent": len(outputs) + len(failures), "completed": len(outputs), "failed": len(failures),
        "hung": sum("timed out" in reason.lower() for reason in failures),
        "failures_by_phase": by_phase, "failure_reasons": sorted(set(failures)),
        "completed_outputs_identical_to_target_only": not mismatched,
        "mismatched": len(mismatched),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "failure_reasons"}, indent=2))
    return 0 if report["hung"] == 0 and not mismatched else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())
