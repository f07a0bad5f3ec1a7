"""Tokenisation and the vocabulary.

Captions are lower-cased and split with nltk's Treebank tokenizer (pure regular expressions, no downloaded data); tokens
with no letter or digit (punctuation) are dropped, as the coco-caption PTB tokenizer does. Ids: <pad>=0, <start>=1,
<end>=2, <unk>=3, then words by decreasing count.
"""

from __future__ import annotations

import functools
import string
from collections import Counter
from collections.abc import Iterable, Sequence

from captioner.errors import CaptionerError

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS = (PAD, START, END, UNK)
PAD_ID, START_ID, END_ID, UNK_ID = range(4)


_EDGE_PUNCTUATION = string.punctuation.replace("'", "")


@functools.cache
def _treebank():
    # nltk is needed to tokenise captions (prepare, metrics), not to caption images: imported here.
    from nltk.tokenize import TreebankWordTokenizer

    return TreebankWordTokenizer()


def tokenize(text: str) -> list[str]:
    """'A man, riding a Horse.' → ['a', 'man', 'riding', 'a', 'horse']"""
    # Any whitespace (\r, \t, ...) as one space: the tokenizer's rules expect spaces.
    text = " ".join(text.lower().split())
    # Treebank splits some punctuation off only at the end of the text ("0." but "0.("): strip it from every token's
    # ends (a leading apostrophe stays: 's, 're), so tokenising is the same wherever a word stands.
    tokens = (t.lstrip(_EDGE_PUNCTUATION).rstrip(string.punctuation) for t in _treebank().tokenize(text))
    return [t for t in tokens if any(ch.isalnum() for ch in t)]


class Vocabulary:
    """Word ↔ id mapping with the four special tokens first."""

    def __init__(self, words: Sequence[str]):
        words = list(words)
        if tuple(words[:4]) != SPECIALS:
            raise CaptionerError(f"vocabulary must start with {SPECIALS}, got {words[:4]}")
        if len(set(words)) != len(words):
            raise CaptionerError("vocabulary has duplicate words")
        self.words = words
        self.index = {w: i for i, w in enumerate(words)}

    @classmethod
    def build(cls, token_lists: Iterable[Sequence[str]], min_count: int = 5) -> Vocabulary:
        """Keep words seen at least `min_count` times; ties broken alphabetically."""
        return cls.from_counts(Counter(t for tokens in token_lists for t in tokens), min_count)

    @classmethod
    def from_counts(cls, counts: Counter, min_count: int = 5) -> Vocabulary:
        """The vocabulary of words counted at least `min_count` times, most frequent first (see `build`)."""
        kept = sorted(
            (w for w, c in counts.items() if c >= min_count and w not in SPECIALS), key=lambda w: (-counts[w], w)
        )
        return cls([*SPECIALS, *kept])

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, tokens: Sequence[str]) -> list[int]:
        """tokens → [<start>, ids..., <end>] with unknown words as <unk>."""
        return [START_ID, *(self.index.get(t, UNK_ID) for t in tokens), END_ID]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """ids → words, stopping at <end> and leaving out <start>/<pad>."""
        words = []
        for i in ids:
            i = int(i)
            if i == END_ID:
                break
            if i in (START_ID, PAD_ID):
                continue
            words.append(self.words[i])
        return words
