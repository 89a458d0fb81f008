"""One byte-level BPE tokenizer shared by the demo target and draft, saved in transformers' format."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_dir: Path):
    """Train a byte-level BPE on ``texts`` and save it with ``save_pretrained`` under ``out_dir``.

    Returns the ``PreTrainedTokenizerFast``; ``AutoTokenizer.from_pretrained(out_dir)`` loads it back.
    Deterministic for the same texts in the same order.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
        model_max_length=2048, clean_up_tokenization_spaces=False,
    )
    tokenizer.save_pretrained(str(out_dir))
    return tokenizer
