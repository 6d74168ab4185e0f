"""The zoo's word-level tokenizer round-trips token ids exactly, loaded the way vLLM loads it."""

from __future__ import annotations

import random

import pytest

from vllm_hybrid_backends.testing.model_zoo import VOCAB_SIZE, build_model
from vllm_hybrid_backends.testing.tokenizer import ids_to_text, save_tokenizer


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    model = build_model("lfm2", tmp_path_factory.mktemp("zoo"))
    save_tokenizer(model)
    return transformers.AutoTokenizer.from_pretrained(model)


def test_round_trip_every_id_and_random_sequences(hf_tokenizer):
    every = list(range(VOCAB_SIZE))
    assert hf_tokenizer.encode(ids_to_text(every), add_special_tokens=False) == every
    assert hf_tokenizer.decode(every) == ids_to_text(every)
    rng = random.Random(7)
    for _ in range(20):
        ids = [rng.randrange(VOCAB_SIZE) for _ in range(rng.randrange(1, 300))]
        text = hf_tokenizer.decode(ids)
        assert hf_tokenizer.encode(text, add_special_tokens=False) == ids


def test_concatenated_text_keeps_the_token_prefix(hf_tokenizer):
    prompt, answer = [5, 9, 300], [7, 7, 42]
    assert hf_tokenizer.encode(ids_to_text(prompt) + "  \n" + ids_to_text(answer),
                               add_special_tokens=False) == prompt + answer


def test_chat_template_joins_turns(hf_tokenizer):
    messages = [{"role": "user", "content": "t5 t9"}, {"role": "assistant", "content": "t7"},
                {"role": "user", "content": "t8"}]
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert list(ids) == [5, 9, 7, 8]


def test_out_of_vocabulary_id_is_refused():
    with pytest.raises(ValueError, match=r"token id 512 is outside the vocabulary \[0, 512\)"):
        ids_to_text([3, 512])


def test_save_is_idempotent(tmp_path):
    save_tokenizer(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    save_tokenizer(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    assert sorted(before) == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
