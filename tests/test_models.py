"""Model loading, the tokenizer compatibility check, and the corpus builders."""

import json

import pytest
import torch

from raysd.demo.corpus import DOC_SEPARATOR, code_documents, json_documents, strip_rst, write_split
from raysd.models import (
    DEMO_DIR,
    DEMO_DRAFT,
    DEMO_TARGET,
    REPO_ROOT,
    ModelDirError,
    TokenizerMismatchError,
    check_tokenizer_compatibility,
    load_causal_lm,
    load_tokenizer,
)


@pytest.mark.slow
def test_demo_models_load_with_plain_transformers_and_generate():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_DIR / "tokenizer"))
    for model_dir, low, high in ((DEMO_TARGET, 10e6, 40e6), (DEMO_DRAFT, 1e6, 4e6)):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        assert low <= model.num_parameters() <= high
        assert AutoTokenizer.from_pretrained(str(model_dir)).get_vocab() == tokenizer.get_vocab()
        prompt = tokenizer('{"id": 1, "name": ', return_tensors="pt")
        output = model.generate(**prompt, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        assert output.shape[1] > prompt["input_ids"].shape[1]
        assert isinstance(tokenizer.decode(output[0]), str)
    target_params = load_causal_lm(DEMO_TARGET).num_parameters()
    assert target_params >= 5 * load_causal_lm(DEMO_DRAFT).num_parameters()
    weights = sum(p.stat().st_size for p in DEMO_DIR.rglob("*.safetensors"))
    assert weights <= 80 * 2**20


def test_missing_model_dir_is_a_clear_error_not_a_download(tmp_path):
    with pytest.raises(ModelDirError, match="never downloads"):
        load_causal_lm("meta-llama/Llama-3-8B")
    with pytest.raises(ModelDirError, match="config.json"):
        load_causal_lm(tmp_path)


def _tiny_tokenizer(tmp_path, name, texts, vocab_size, specials=("<|endoftext|>",)):
    from raysd.demo.tokenizer import train_tokenizer

    out = tmp_path / name
    tokenizer = train_tokenizer(texts, vocab_size, out)
    if specials != ("<|endoftext|>",):
        tokenizer.add_special_tokens({"eos_token": specials[0]})
        tokenizer.save_pretrained(str(out))
    return load_tokenizer(out)


def test_mismatched_tokenizers_are_refused_naming_what_differs(tmp_path):
    texts = ["def f(x):\n    return x + 1\n" * 20, '{"a": 1, "b": [1, 2]}' * 20, "the cat sat on the mat " * 40]
    same_a = _tiny_tokenizer(tmp_path, "a", texts, 300)
    same_b = _tiny_tokenizer(tmp_path, "b", texts, 300)
    check_tokenizer_compatibility(same_a, same_b)  # identical training → compatible, no error
    smaller = _tiny_tokenizer(tmp_path, "c", texts, 280)
    with pytest.raises(TokenizerMismatchError) as error:
        check_tokenizer_compatibility(same_a, smaller)
    message = str(error.value)
    assert "vocab size: target" in message and "encodes differently" in message
    other_eos = _tiny_tokenizer(tmp_path, "d", texts, 300, specials=("<eos>",))
    with pytest.raises(TokenizerMismatchError, match="special token eos_token"):
        check_tokenizer_compatibility(same_a, other_eos)
    with pytest.raises(TokenizerMismatchError, match="embedding rows"):
        check_tokenizer_compatibility(same_a, same_b, model_vocab_sizes=(300, 320))


def test_corpus_builders_are_deterministic(tmp_path):
    first = list(json_documents(200, seed=3))
    assert first == list(json_documents(200, seed=3))
    assert first != list(json_documents(200, seed=4))
    schemas = {name.split("-")[0] for name, _ in first}
    assert len(schemas) >= 5
    for _, text in first:
        json.loads(text)  # every document is valid JSON
    assert any("\n" in text for _, text in first) and any("\n" not in text for _, text in first)

    code = list(code_documents())[:40]
    assert code == list(code_documents())[:40]
    assert all(not name.startswith(("test/", "idlelib/")) for name, _ in code)
    sizes_a = write_split(iter(code), tmp_path / "a")
    sizes_b = write_split(iter(code), tmp_path / "b")
    assert sizes_a == sizes_b
    assert (tmp_path / "a" / "train.txt").read_bytes() == (tmp_path / "b" / "train.txt").read_bytes()
    assert DOC_SEPARATOR in (tmp_path / "a" / "train.txt").read_text()


def test_strip_rst_keeps_prose_and_drops_markup():
    rst = (
        "Title\n=====\n\n.. note::\n\n   hidden directive body\n\n"
        "Use :func:`len` and ``x`` here, see `docs <http://x>`_.\n\nExample::\n\n    code block\n\nAfter.\n"
    )
    text = strip_rst(rst)
    assert "Use len and x here, see docs." in text
    assert "hidden directive" not in text and "code block" not in text and "=====" not in text
    assert text.endswith("After.")


def test_recorded_agreement_traces_are_what_the_shipped_pair_does():
    """``tests/data/demo_agreement.json`` (the policy tests replay it) matches the demo pair as shipped: the
    first prompt of each workload, decoded again, agrees with the draft at the recorded positions. Retrain
    the pair and this fails until ``python bench/agreement_traces.py --out tests/data/demo_agreement.json``."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("agreement_traces", REPO_ROOT / "bench" / "agreement_traces.py")
    traces_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(traces_module)
    recorded = json.loads((REPO_ROOT / "tests" / "data" / "demo_agreement.json").read_text())
    records = [json.loads(line) for line in (REPO_ROOT / recorded["prompts"]).read_text().splitlines()]
    target, draft = load_causal_lm(DEMO_TARGET), load_causal_lm(DEMO_DRAFT)
    tokenizer = load_tokenizer(DEMO_TARGET)
    for workload in ("code", "json", "prose"):
        prompt = next(record["prompt"] for record in records if record["workload"] == workload)
        prompt_ids = tokenizer(prompt, return_tensors="pt").input_ids
        again = traces_module.agreement(target, draft, prompt_ids, recorded["max_tokens"],
                                        tokenizer.eos_token_id or 0)
        assert again == recorded["agreement"][workload][0]
        assert 0 < sum(again) < len(again)  # a real pattern, neither all agreement nor none
