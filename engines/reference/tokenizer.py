"""A fixed character tokenizer (3 special ids, then 29 characters: vocab 32), so ``/generate`` takes ``text``."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["BOS_ID", "EOS_ID", "PAD_ID", "SPECIAL_IDS", "VOCAB", "CharTokenizer"]

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
SPECIAL_IDS = frozenset({PAD_ID, BOS_ID, EOS_ID})

# Index = token id. Specials first so the character ids never move when specials are added.
VOCAB: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", *"abcdefghijklmnopqrstuvwxyz", " ", ".", ",")


class CharTokenizer:
    """Encodes lower-cased text one character per token; decoding skips specials by default."""

    def __init__(self) -> None:
        self._ids = {ch: i for i, ch in enumerate(VOCAB) if i not in SPECIAL_IDS}

    vocab_size, eos_token_id, bos_token_id = len(VOCAB), EOS_ID, BOS_ID

    def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
        """Token ids for ``text``; upper case folds to lower, any other unknown character is an error."""
        ids = [BOS_ID] if add_bos else []
        for pos, ch in enumerate(text.lower()):
            try:
                ids.append(self._ids[ch])
            except KeyError:
                raise ValueError(f"character {ch!r} at position {pos} is not in the reference tokenizer's vocabulary "
                                 f"(a-z, space, '.', ',')") from None
        return ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        out = []
        for i in ids:
            if not 0 <= i < len(VOCAB):
                raise ValueError(f"token id {i} is outside the vocabulary (0..{len(VOCAB) - 1})")
            if skip_special_tokens and i in SPECIAL_IDS:
                continue
            out.append(VOCAB[i])
        return "".join(out)
