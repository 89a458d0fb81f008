"""Where the demo draft agrees with the demo target, token by token, on the held-out prompts.

For each prompt the target decodes ``--max-tokens`` greedily; one forward of the draft over prompt + output then
gives the draft's greedy choice at every output position, given the target's own prefix — exactly what a
greedy speculative round checks (a round drafting k from position i accepts the run of agreements from i, at
most k). The result, per workload a list of 0/1 vectors, is the real text's acceptance pattern with its
stretches: the policy tests replay it in a simulated batch-1 world (``tests/test_policy.py``) instead of
assuming acceptance independent from token to token.

    python bench/agreement_traces.py --out tests/data/demo_agreement.json      # ~40 s here
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def agreement(target, draft, prompt_ids, max_tokens: int, pad_token_id: int) -> list[int]:
    """1 where the draft's greedy token equals the target's greedy output token, for each output position;
    ``prompt_ids``: (1, prompt_len) token ids."""
    import torch

    with torch.no_grad():
        sequence = target.generate(prompt_ids, max_new_tokens=max_tokens, do_sample=False,
                                   pad_token_id=pad_token_id)
        prompt_len = prompt_ids.shape[1]
        draft_choice = draft(sequence).logits[0, prompt_len - 1:-1].argmax(-1)
    return (draft_choice == sequence[0, prompt_len:]).int().tolist()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=Path, default=REPO / "bench" / "prompts" / "heldout.jsonl")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    if not args.prompts.is_file():
        parser.error(f"--prompts {str(args.prompts)!r} is not a file")
    if args.max_tokens < 1:
        parser.error("--max-tokens must be ≥ 1")
    sys.path.insert(0, str(REPO))
    from tqdm import tqdm

    from raysd.models import DEMO_DRAFT, DEMO_TARGET, load_causal_lm, load_tokenizer

    target, draft = load_causal_lm(DEMO_TARGET), load_causal_lm(DEMO_DRAFT)
    tokenizer = load_tokenizer(DEMO_TARGET)
    records = [json.loads(line) for line in args.prompts.read_text().splitlines() if line.strip()]
    traces: dict[str, list[list[int]]] = {}
    for record in tqdm(records, desc="prompts", unit="prompt"):
        prompt_ids = tokenizer(record["prompt"], return_tensors="pt").input_ids
        traces.setdefault(record["workload"], []).append(
            agreement(target, draft, prompt_ids, args.max_tokens, tokenizer.eos_token_id or 0))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"prompts": str(args.prompts.relative_to(REPO)) if args.prompts.is_relative_to(REPO)
                                    else str(args.prompts), "max_tokens": args.max_tokens,
                                    "agreement": traces}) + "\n")
    for workload, vectors in traces.items():
        positions = sum(len(vector) for vector in vectors)
        print(f"{workload}: {len(vectors)} prompts, agreement {sum(map(sum, vectors)) / positions:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
