"""Load local Hugging Face causal-LM directories and check that a target/draft pair shares a tokenizer.

Nothing here reaches for a model hub: a path that is not a local model directory is an error that says
so, and every ``from_pretrained`` call passes ``local_files_only=True``.
"""

from __future__ import annotations

from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_DIR = REPO_ROOT / "models" / "demo"
DEMO_TARGET = DEMO_DIR / "target"
DEMO_DRAFT = DEMO_DIR / "draft"

_SAMPLE_TEXTS = (
    'def add(a, b):\n    return a + b\n',
    '{"id": 42, "name": "Ada", "tags": ["x", "y"]}',
    "The quick brown fox jumps over the lazy dog. Ünïcödé ✓ 数字 123",
)


class ModelDirError(ValueError):
    """A path given as a model or tokenizer directory is not one."""


class TokenizerMismatchError(ValueError):
    """Target and draft tokenizers disagree; speculative decoding would not be lossless."""


def _require_model_dir(path: Path | str, what: str) -> Path:
    model_dir = Path(path).expanduser()
    if not model_dir.is_dir():
        raise ModelDirError(
            f"{what} {str(path)!r} is not a local directory. raysd loads models only from local "
            "Hugging Face directories (config.json + weights) and never downloads; pass the path to one, "
            f"for example {DEMO_TARGET}.")
    if not (model_dir / "config.json").is_file():
        raise ModelDirError(f"{what} {str(model_dir)!r} has no config.json; point at the folder that "
                            "`save_pretrained` wrote.")
    return model_dir


def load_causal_lm(path: Path | str, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """Load a causal LM from a local directory in eval mode, as ``dtype`` on ``device``."""
    from transformers import AutoModelForCausalLM

    model_dir = _require_model_dir(path, "model directory")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, local_files_only=True,
                                                 attn_implementation="sdpa")
    return model.to(device).eval()


def load_tokenizer(path: Path | str):
    """Load the tokenizer of a model directory (or its sibling ``tokenizer/`` folder), local files only."""
    from transformers import AutoTokenizer

    model_dir = Path(path).expanduser()
    for candidate in (model_dir, model_dir.parent / "tokenizer"):
        if (candidate / "tokenizer.json").is_file() or (candidate / "tokenizer_config.json").is_file():
            return AutoTokenizer.from_pretrained(str(candidate), local_files_only=True)
    raise ModelDirError(f"no tokenizer files in {str(model_dir)!r} or {str(model_dir.parent / 'tokenizer')!r};"
                        " copy the tokenizer into the model directory with `tokenizer.save_pretrained`.")


def tokenizer_differences(target_tokenizer, draft_tokenizer, model_vocab_sizes: tuple[int, int] | None = None,
                          sample_texts: tuple[str, ...] = _SAMPLE_TEXTS) -> list[str]:
    """Everything that differs between two tokenizers in ways that break lossless speculation.

    Compares vocabulary size (and, when given, the two models' embedding sizes), special tokens, the ids
    of sample texts, and how sample ids decode. Returns human-readable differences; empty means compatible.
    """
    differences = []
    if len(target_tokenizer) != len(draft_tokenizer):
        differences.append(f"vocab size: target {len(target_tokenizer)} vs draft {len(draft_tokenizer)}")
    if model_vocab_sizes is not None and model_vocab_sizes[0] != model_vocab_sizes[1]:
        differences.append(f"model vocab size (embedding rows): target {model_vocab_sizes[0]} vs draft "
                           f"{model_vocab_sizes[1]}")
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        target_token, draft_token = getattr(target_tokenizer, name), getattr(draft_tokenizer, name)
        target_id, draft_id = getattr(target_tokenizer, f"{name}_id"), getattr(draft_tokenizer, f"{name}_id")
        if (target_token, target_id) != (draft_token, draft_id):
            differences.append(f"special token {name}: target {target_token!r} (id {target_id}) vs draft "
                               f"{draft_token!r} (id {draft_id})")
    for text in sample_texts:
        target_ids = target_tokenizer.encode(text, add_special_tokens=False)
        draft_ids = draft_tokenizer.encode(text, add_special_tokens=False)
        if target_ids != draft_ids:
            differences.append(f"sample {text[:24]!r} encodes differently: target {target_ids[:8]}… vs "
                               f"draft {draft_ids[:8]}…")
        common_vocab = min(len(target_tokenizer), len(draft_tokenizer))
        probe_ids = [token_id for token_id in target_ids if token_id < common_vocab]
        if target_tokenizer.decode(probe_ids) != draft_tokenizer.decode(probe_ids):
            differences.append(f"sample ids {probe_ids[:8]}… decode differently")
    step = max(1, min(len(target_tokenizer), len(draft_tokenizer)) // 64)
    for token_id in range(0, min(len(target_tokenizer), len(draft_tokenizer)), step):
        if target_tokenizer.convert_ids_to_tokens(token_id) != draft_tokenizer.convert_ids_to_tokens(token_id):
            differences.append(f"token id {token_id}: target {target_tokenizer.convert_ids_to_tokens(token_id)!r}"
                               f" vs draft {draft_tokenizer.convert_ids_to_tokens(token_id)!r}")
            break
    return differences


def check_tokenizer_compatibility(target_tokenizer, draft_tokenizer,
                                  model_vocab_sizes: tuple[int, int] | None = None) -> None:
    """Raise ``TokenizerMismatchError`` naming every difference, or return when the pair is compatible."""
    differences = tokenizer_differences(target_tokenizer, draft_tokenizer, model_vocab_sizes)
    if differences:
        raise TokenizerMismatchError(
            "the draft model's tokenizer does not match the target's, so its proposals cannot be verified "
            "token for token:\n  - " + "\n  - ".join(differences)
            + "\nUse a draft trained with the target's tokenizer (or the n-gram drafter, which needs none).")


class ModelPair:
    """A target and (optionally) a draft model with the target's tokenizer, checked to be compatible."""

    def __init__(self, target_dir: Path | str, draft_dir: Path | str | None = None,
                 dtype: torch.dtype = torch.float32, device: str = "cpu"):
        self.tokenizer = load_tokenizer(target_dir)
        self.target = load_causal_lm(target_dir, dtype, device)
        self.draft = None
        if draft_dir is not None:
            draft_tokenizer = load_tokenizer(draft_dir)
            self.draft = load_causal_lm(draft_dir, dtype, device)
            check_tokenizer_compatibility(
                self.tokenizer, draft_tokenizer,
                (self.target.get_input_embeddings().num_embeddings,
                 self.draft.get_input_embeddings().num_embeddings))
