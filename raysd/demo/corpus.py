"""Offline corpora for the demo model pair: code, JSON and prose, each with a held-out split.

Every builder is deterministic: the same sources and seed give byte-identical output. Documents are
separated by ``DOC_SEPARATOR`` so training can insert the end-of-text token between them.

Sources (nothing is fetched from a model or data hub):
- code: the Python standard library's own ``*.py`` files (test folders and idlelib left out); PSF licence.
- json: records from seeded generators over several schemas, mixed indented and compact.
- prose: Debian packages ``python3.11-doc`` (reStructuredText sources of the Python docs, markup stripped;
  PSF licence), ``fortunes``/``fortunes-min`` (fortune-mod collections; BSD-style and public-domain
  pieces) and ``jargon-text`` (the Jargon File, public domain), fetched with ``apt-get download`` and
  unpacked with ``dpkg -x`` into the output folder; nothing is installed system-wide.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

DOC_SEPARATOR = "\n\x1e\n"  # ASCII record separator: never occurs in the sources
WORKLOADS = ("code", "json", "prose")
PROSE_PACKAGES = ("python3.11-doc", "fortunes", "fortunes-min", "jargon-text")
_SKIP_CODE_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3"}
_SKIP_FORTUNES = {"art", "ascii-art"}


def is_heldout(name: str, heldout_percent: int = 5) -> bool:
    """Deterministic split by document name: ``heldout_percent`` of names (by hash) are held out."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:4], "big") % 100 < heldout_percent


# ----------------------------------------------------------------------------------------------- code
def code_documents(stdlib_dir: Path | None = None) -> Iterator[tuple[str, str]]:
    """Yield ``(relative_name, source_text)`` for the standard library's ``*.py`` files, sorted by name."""
    root = Path(stdlib_dir or sysconfig.get_paths()["stdlib"])
    paths = sorted(
        path
        for path in root.rglob("*.py")
        if not (set(path.relative_to(root).parts[:-1]) & _SKIP_CODE_DIRS)
        and not path.name.startswith("test_")
    )
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip():
            yield str(path.relative_to(root)), text


# ----------------------------------------------------------------------------------------------- json
_FIRST = ["ada", "alan", "grace", "linus", "margaret", "ken", "barbara", "dennis", "edsger", "frances"]
_LAST = ["lovelace", "turing", "hopper", "torvalds", "hamilton", "thompson", "liskov", "ritchie"]
_CITIES = ["Berlin", "Lagos", "Lima", "Osaka", "Toronto", "Nairobi", "Oslo", "Pune", "Quito", "Perth"]
_WORDS = ["alpha", "beta", "gamma", "delta", "cache", "queue", "batch", "token", "shard", "replica"]
_LEVELS = ["DEBUG", "INFO", "INFO", "INFO", "WARNING", "ERROR"]
_STATUS = ["pending", "paid", "shipped", "delivered", "cancelled"]


def _iso_time(rng: random.Random) -> str:
    return (
        f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T"
        f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:{rng.randint(0, 59):02d}Z"
    )


def _user(rng: random.Random) -> dict:
    first, last = rng.choice(_FIRST), rng.choice(_LAST)
    return {
        "id": rng.randint(1000, 99999),
        "name": f"{first.title()} {last.title()}",
        "email": f"{first}.{last}@example.com",
        "age": rng.randint(18, 90),
        "active": rng.random() < 0.8,
        "address": {"city": rng.choice(_CITIES), "zip": f"{rng.randint(10000, 99999)}"},
        "tags": rng.sample(_WORDS, rng.randint(0, 3)),
    }


def _order(rng: random.Random) -> dict:
    items = [
        {"sku": f"SKU-{rng.randint(100, 999)}", "quantity": rng.randint(1, 5),
         "unit_price": round(rng.uniform(1, 200), 2)}
        for _ in range(rng.randint(1, 4))
    ]
    return {
        "order_id": f"ord_{rng.randint(10**6, 10**7 - 1)}",
        "customer_id": rng.randint(1000, 99999),
        "status": rng.choice(_STATUS),
        "items": items,
        "total": round(sum(item["quantity"] * item["unit_price"] for item in items), 2),
        "currency": rng.choice(["EUR", "USD", "JPY"]),
        "created_at": _iso_time(rng),
    }


def _log_event(rng: random.Random) -> dict:
    return {
        "timestamp": _iso_time(rng),
        "level": rng.choice(_LEVELS),
        "service": f"{rng.choice(_WORDS)}-service",
        "message": f"{rng.choice(['request', 'job', 'task'])} {rng.choice(['started', 'finished', 'failed'])}",
        "latency_ms": round(rng.expovariate(1 / 40), 1),
        "trace_id": f"{rng.getrandbits(128):032x}",
    }


def _sensor(rng: random.Random) -> dict:
    return {
        "device_id": f"sensor-{rng.randint(1, 500):03d}",
        "location": {"lat": round(rng.uniform(-60, 60), 4), "lon": round(rng.uniform(-180, 180), 4)},
        "readings": [
            {"metric": metric, "value": round(rng.gauss(mean, 3), 2)}
            for metric, mean in (("temperature", 21.0), ("humidity", 45.0), ("pressure", 1013.0))
            if rng.random() < 0.8
        ],
        "battery": rng.randint(0, 100),
        "recorded_at": _iso_time(rng),
    }


def _product(rng: random.Random) -> dict:
    return {
        "product_id": rng.randint(1, 10**5),
        "title": f"{rng.choice(_WORDS).title()} {rng.choice(['Pro', 'Mini', 'Max', 'Lite'])}",
        "price": round(rng.uniform(5, 900), 2),
        "in_stock": rng.random() < 0.7,
        "categories": rng.sample(["tools", "books", "garden", "audio", "games", "kitchen"], 2),
        "rating": {"average": round(rng.uniform(1, 5), 1), "count": rng.randint(0, 5000)},
    }


def _chat_call(rng: random.Random) -> dict:
    return {
        "name": rng.choice(["get_weather", "search_docs", "create_ticket", "lookup_user"]),
        "arguments": {"query": " ".join(rng.sample(_WORDS, 2)), "limit": rng.randint(1, 50),
                      "city": rng.choice(_CITIES)},
        "call_id": f"call_{rng.getrandbits(40):010x}",
    }


JSON_SCHEMAS: dict[str, Callable[[random.Random], dict]] = {
    "user": _user, "order": _order, "log_event": _log_event, "sensor": _sensor,
    "product": _product, "tool_call": _chat_call,
}


def json_documents(num_documents: int, seed: int) -> Iterator[tuple[str, str]]:
    """Yield ``num_documents`` JSON documents: each a list of 1–4 records of one schema, some indented."""
    rng = random.Random(seed)
    names = sorted(JSON_SCHEMAS)
    for index in range(num_documents):
        schema = rng.choice(names)
        records = [JSON_SCHEMAS[schema](rng) for _ in range(rng.randint(1, 4))]
        payload: object = records[0] if len(records) == 1 else records
        indent = rng.choice([None, 2, 2, 4])
        separators = (",", ":") if indent is None and rng.random() < 0.5 else None
        yield f"{schema}-{index}", json.dumps(payload, indent=indent, separators=separators)


# ---------------------------------------------------------------------------------------------- prose
_ROLE = re.compile(r":[a-zA-Z:]+:`~?([^`<]*?)(?:\s*<[^>]*>)?`")
_LITERAL = re.compile(r"``([^`]*)``")
_LINK = re.compile(r"`([^`<]+?)\s*<[^>]*>`_+")
_EMPHASIS = re.compile(r"\*{1,2}([^*\n]+)\*{1,2}")


def strip_rst(text: str) -> str:
    """Turn reStructuredText into plain paragraphs: drop directives, code blocks, tables and titles' rules."""
    kept: list[str] = []
    in_block = False
    for raw_line in text.splitlines():
        line = raw_line.rstrip()
        if in_block:
            if line and not line[0].isspace():
                in_block = False
            else:
                continue
        stripped = line.strip()
        if stripped.startswith(".."):
            in_block = True
            continue
        if line.startswith((" ", "\t")) or stripped.startswith((">>>", "+--", "|", "===", "---")):
            continue
        if stripped and len(set(stripped)) == 1 and stripped[0] in "=-~^*#+`'\"":
            continue
        if stripped.endswith("::"):
            line = line[:-1]
            in_block = True
        line = _ROLE.sub(r"\1", line)
        line = _LINK.sub(r"\1", line)
        line = _LITERAL.sub(r"\1", line)
        kept.append(_EMPHASIS.sub(r"\1", line))
    paragraphs = "\n".join(kept)
    return re.sub(r"\n{3,}", "\n\n", paragraphs).strip()


def fetch_prose_packages(dest: Path) -> Path:
    """``apt-get download`` the prose packages and ``dpkg -x`` them under ``dest``; return the root."""
    root = dest / "debian"
    if (root / "usr").exists():
        return root
    with tempfile.TemporaryDirectory() as download_dir:
        subprocess.run(["apt-get", "download", *PROSE_PACKAGES], cwd=download_dir, check=True,
                       capture_output=True)
        for deb in sorted(Path(download_dir).glob("*.deb")):
            subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    return root


def prose_documents(debian_root: Path) -> Iterator[tuple[str, str]]:
    """Yield prose documents from the unpacked Debian packages, sorted by name within each source."""
    sources = debian_root / "usr/share/doc/python3.11/html/_sources"
    for path in sorted(sources.rglob("*.rst.txt")):
        text = strip_rst(path.read_text(encoding="utf-8", errors="replace"))
        if len(text) > 200:
            yield f"pydoc/{path.relative_to(sources)}", text
    fortunes = debian_root / "usr/share/games/fortunes"
    for path in sorted(fortunes.glob("*")):
        if path.suffix or path.name in _SKIP_FORTUNES or not path.is_file():
            continue
        for index, entry in enumerate(path.read_text(encoding="utf-8", errors="replace").split("\n%\n")):
            if entry.strip():
                yield f"fortune/{path.name}/{index}", entry.strip()
    jargon = debian_root / "usr/share/doc/jargon-text/jargon.txt.gz"
    if jargon.exists():
        text = gzip.decompress(jargon.read_bytes()).decode("utf-8", errors="replace")
        for index, entry in enumerate(re.split(r"\n(?=:[^:\n]+:)", text)):
            if len(entry.strip()) > 40:
                yield f"jargon/{index}", entry.strip()


# ---------------------------------------------------------------------------------------------- build
def write_split(documents: Iterator[tuple[str, str]], out_dir: Path, heldout_percent: int = 5) -> dict:
    """Write ``train.txt`` / ``heldout.txt`` under ``out_dir``; return the split's sizes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    parts: dict[str, list[str]] = {"train": [], "heldout": []}
    for name, text in documents:
        parts["heldout" if is_heldout(name, heldout_percent) else "train"].append(text)
    sizes = {}
    for split, texts in parts.items():
        body = DOC_SEPARATOR.join(texts)
        (out_dir / f"{split}.txt").write_text(body, encoding="utf-8")
        sizes[split] = {"documents": len(texts), "bytes": len(body.encode("utf-8"))}
    return sizes


def build_corpora(out_dir: Path, seed: int = 0, json_documents_count: int = 12000,
                  stdlib_dir: Path | None = None, debian_root: Path | None = None) -> dict:
    """Build all three corpora under ``out_dir/<workload>/``; return ``{workload: sizes}``.

    The JSON held-out split comes from a different seed, so no held-out record was seen in training.
    """
    out_dir = Path(out_dir)
    stats = {"code": write_split(code_documents(stdlib_dir), out_dir / "code")}
    json_dir = out_dir / "json"
    train = write_split(json_documents(json_documents_count, seed), json_dir, heldout_percent=0)
    heldout_docs = [text for _, text in json_documents(max(json_documents_count // 20, 50), seed + 1)]
    (json_dir / "heldout.txt").write_text(DOC_SEPARATOR.join(heldout_docs), encoding="utf-8")
    train["heldout"] = {"documents": len(heldout_docs),
                        "bytes": (json_dir / "heldout.txt").stat().st_size}
    stats["json"] = train
    root = debian_root or fetch_prose_packages(out_dir)
    stats["prose"] = write_split(prose_documents(Path(root)), out_dir / "prose")
    (out_dir / "corpus_stats.json").write_text(json.dumps(stats, indent=2))
    if debian_root is None:
        shutil.rmtree(out_dir / "debian", ignore_errors=True)
    return stats


def read_documents(path: Path) -> list[str]:
    """Read a split file back into its documents."""
    return [doc for doc in Path(path).read_text(encoding="utf-8").split(DOC_SEPARATOR) if doc]
