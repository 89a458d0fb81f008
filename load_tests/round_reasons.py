"""Why a window's rounds did or did not draft: the policy's reasons, counted by the server per request.

Each response's ``speculation.rounds_by_reason`` counts the rounds of that request each reason decided
(``raysd.policy``: ``adaptive``, ``warmup``, ``probe`` and ``fixed`` draft; ``low_acceptance``,
``measured_slower``, ``measure_plain``, ``pressure`` and ``off`` hold the row at k = 0; ``prefill`` is the
request's first round, which never drafts). The locustfile sums them per window; the sweep keeps the counts in
``sweep_passes.csv`` (column ``round_reasons``, JSON) and prints their shares for adaptive in ``summary.md``, so
a shortfall can be read as "held at k = 0 by the cost model" or "by the goodput check" without a round log.
"""

from __future__ import annotations

import json

DRAFTING = ("adaptive", "warmup", "probe", "fixed")
SHOWN = (("drafting", DRAFTING), ("low acceptance", ("low_acceptance",)),
         ("measured slower", ("measured_slower", "measure_plain")), ("gate", ("pressure",)))


def encode(counts: dict[str, int] | None) -> str | None:
    """The CSV cell for ``counts`` (reason → rounds): JSON with sorted keys; None without any."""
    return json.dumps(dict(sorted(counts.items()))) if counts else None


def decode(cell: str | dict | None) -> dict[str, int]:
    """Reason → rounds from a CSV cell written by ``encode`` (or a dict already); {} for an empty cell."""
    if not cell:
        return {}
    return dict(cell) if isinstance(cell, dict) else {str(k): int(v) for k, v in json.loads(cell).items()}


def merge(cells: list[str | dict | None]) -> str | None:
    """Several windows' cells summed into one."""
    total: dict[str, int] = {}
    for cell in cells:
        for reason, rounds in decode(cell).items():
            total[reason] = total.get(reason, 0) + rounds
    return encode(total)


def decoding_shares(cell: str | dict | None) -> dict[str, float] | None:
    """Share of the decoding rounds (``prefill`` left out) per group of ``SHOWN``; None without decoding rounds."""
    counts = decode(cell)
    decoding = sum(rounds for reason, rounds in counts.items() if reason != "prefill")
    if not decoding:
        return None
    return {label: sum(counts.get(reason, 0) for reason in reasons) / decoding for label, reasons in SHOWN}


def markdown_row(policy: str, cells: list[str | dict | None]) -> str:
    """A summary table row for ``policy``: per cell, the percentages of ``SHOWN`` joined by " / " ("–" where
    none)."""
    label = f"{policy} rounds, %: " + " / ".join(name for name, _ in SHOWN)
    values = []
    for cell in cells:
        shares = decoding_shares(cell)
        values.append(" / ".join(f"{100 * share:.0f}" for share in shares.values()) if shares else "–")
    return f"| {label} | " + " | ".join(values) + " |"
