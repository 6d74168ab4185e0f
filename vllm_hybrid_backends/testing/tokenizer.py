"""A deterministic word-level tokenizer for the zoo models, so unmodified ``vllm serve`` works.

Token id ``i`` is the word ``t<i>``: ``ids_to_text([5, 9])`` is ``"t5 t9"`` and encoding that
text gives ``[5, 9]`` back, exactly, for every id below the vocabulary size (byte-level BPE
does not round-trip arbitrary id sequences; this does).  Any run of whitespace separates words,
so ``prompt + " " + answer`` encodes to the prompt's ids followed by the answer's: a multi-turn
client that sends text keeps the token-level prefix structure.

:func:`save_tokenizer` writes ``tokenizer.json`` (the ``tokenizers`` library's format),
``tokenizer_config.json`` (with a chat template that joins the messages' contents with spaces)
and ``special_tokens_map.json`` beside the model.  Written atomically and only when missing,
so concurrent builders and servers never see half a tokenizer.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .model_zoo import VOCAB_SIZE

__all__ = ["CHAT_TEMPLATE", "WORD_PREFIX", "ids_to_text", "make_tokenizer", "save_tokenizer"]

WORD_PREFIX = "t"
_META = "\u2581"  # the Metaspace marker: it carries the space before each word
#: Each message's content followed by a space: a conversation's text is the concatenation of
#: its turns, so the next request's tokens extend the previous request's.
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
_SPECIAL = {"pad_token": 0, "bos_token": 1, "eos_token": 2}
_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def ids_to_text(ids: Iterable[int], vocab_size: int = VOCAB_SIZE) -> str:
    """The text that this tokenizer encodes to exactly ``ids``."""
    words = []
    for i in ids:
        if not 0 <= int(i) < vocab_size:
            raise ValueError(f"token id {i!r} is outside the vocabulary [0, {vocab_size})")
        words.append(f"{WORD_PREFIX}{int(i)}")
    return " ".join(words)


def make_tokenizer(vocab_size: int = VOCAB_SIZE) -> Any:
    """A ``tokenizers.Tokenizer``: word ``t<i>`` is id ``i``, whitespace separates words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"{_META}{WORD_PREFIX}{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=f"{_META}{WORD_PREFIX}0"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement=_META, prepend_scheme="always"),
    ])
    tok.decoder = decoders.Metaspace(replacement=_META, prepend_scheme="always")
    return tok


def _word(i: int) -> str:
    return f"{_META}{WORD_PREFIX}{i}"


def save_tokenizer(model_dir: Path, vocab_size: int = VOCAB_SIZE) -> Path:
    """Write the tokenizer files into ``model_dir`` unless they are all there; return the dir."""
    model_dir = Path(model_dir)
    if all((model_dir / name).is_file() for name in _FILES):
        return model_dir
    special = {key: _word(i) for key, i in _SPECIAL.items()}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        **special,
    }
    contents = {
        "tokenizer.json": make_tokenizer(vocab_size).to_str(pretty=True),
        "tokenizer_config.json": json.dumps(config, indent=2, sort_keys=True) + "\n",
        "special_tokens_map.json": json.dumps(special, indent=2, sort_keys=True) + "\n",
    }
    for name, text in contents.items():
        fd, tmp = tempfile.mkstemp(prefix=f".{name}-", dir=model_dir)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, model_dir / name)
    return model_dir
