"""CIDEr-D and sentence BLEU-4 on token ids, vectorised: the rewards of self-critical training.

CIDEr-D as coco-caption computes it (pycocoevalcap's `Cider`: clipped weights and a Gaussian
length penalty). For n = 1..4 a caption is a vector v of tf·idf weights of its n-grams, with
idf(g) = log N − log max(1, df(g)), df counted over N documents (one document is the set of an
image's reference n-grams). A candidate c scores against each reference r of its image
    sim_n(c, r) = Σ_g min(v_c(g), v_r(g)) v_r(g) / (‖v_c,n‖ ‖v_r,n‖) · exp(−δ² / 2σ²),  σ = 6,
where δ is the difference of the two captions' bigram counts (coco-caption measures length
that way: words − 1), and CIDEr-D(c) = 10 · mean_n mean_r sim_n(c, r).

N-grams are integer codes, never strings: (w1, ..., wn) of ids in [1, base) is the int64 Σ w_i base^(n−i), exact while
base^4 < 2^63, and it lies in [base^(n−1), base^n), so the code also tells the order.
Symbols: N candidates, T tokens (ids ≥ 1; whatever follows a sequence's length is ignored), C reference captions, G
distinct reference n-grams, E (caption, n-gram) entries, P (candidate, reference) pairs, Q (entry, reference) pairs.
"""

from __future__ import annotations

import hashlib
import logging
import zipfile
from dataclasses import dataclass

import numpy as np
import torch

from captioner.errors import CaptionerError
from captioner.io import atomic_path

ORDERS = 4  # n-grams of 1..4 words
SIGMA = 6.0  # σ of the length penalty
CACHE_FORMAT = "captioner-cider-df/1"
_TINY, _SMALL = 1e-15, 1e-9  # coco-caption BLEU's guards against 0/0, kept for equal scores

log = logging.getLogger(__name__)


def check_base(base: int) -> None:
    if base**ORDERS >= 2**63:
        raise CaptionerError(
            f"a vocabulary of {base} words is too large for exact 4-gram codes "
            f"(at most {int((2**63 - 1) ** 0.25)}); raise --min-count"
        )


def ngrams(tokens: torch.Tensor, lengths: torch.Tensor, base: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every distinct n-gram (n = 1..4) of each sequence (N, T) and its count: owner, code (int64) and
    count (float64), each (E,), sorted by owner."""
    tokens, lengths = tokens.long(), lengths.long()
    N, T = tokens.shape
    owners, codes = [], []
    code = torch.zeros(N, T, dtype=torch.long)
    for k in range(min(ORDERS, T)):
        code = code[:, : T - k] * base + tokens[:, k:]  # (N, T-k), (k+1)-grams
        valid = torch.arange(T - k).unsqueeze(0) < (lengths - k).unsqueeze(1)  # (N, T-k)
        owners.append(valid.nonzero()[:, 0]), codes.append(code[valid])
    owner = torch.cat(owners) if owners else torch.zeros(0, dtype=torch.long)  # (M,) occurrences
    code = torch.cat(codes) if codes else torch.zeros(0, dtype=torch.long)
    if not len(code):
        empty = torch.zeros(0, dtype=torch.long)
        return empty, empty, torch.zeros(0, dtype=torch.float64)
    # Count (owner, code) pairs: codes are first renumbered densely so the pair fits one int64.
    distinct, dense = torch.unique(code, return_inverse=True)  # (K,), (M,)
    pairs, count = torch.unique(owner * len(distinct) + dense, return_counts=True)  # (E,)
    return pairs // len(distinct), distinct[pairs % len(distinct)], count.double()


def order_of(code: torch.Tensor, base: int) -> torch.Tensor:
    """n − 1 for each n-gram code (E,)."""
    return sum((code >= base**k).long() for k in range(1, ORDERS))


def _lookup(table: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Position of each key in a sorted table, and whether it is there."""
    if not len(table):
        return torch.zeros_like(keys), torch.zeros(keys.shape, dtype=torch.bool)
    pos = torch.searchsorted(table, keys).clamp_max(len(table) - 1)
    return pos, table[pos] == keys


@dataclass
class References:
    """Reference captions as ids: what candidates are scored against, and where df comes from."""

    tokens: torch.Tensor  # (C, T) ids ≥ 1, anything after each length
    lengths: torch.Tensor  # (C,) tokens per caption
    images: torch.Tensor  # (C,) image (document) of each caption, ≥ 0
    base: int  # larger than every id (the vocabulary size)

    def fingerprint(self, salt: str = "") -> str:
        """Changes whenever the captions, their images, the base or `salt` do."""
        h = hashlib.sha256(f"{CACHE_FORMAT}|{self.base}|{salt}|".encode())
        for t in (self.tokens, self.lengths, self.images):
            t = t.long().contiguous()
            h.update(str(tuple(t.shape)).encode())
            h.update(t.numpy().tobytes())
        return h.hexdigest()


@dataclass
class DocumentFrequency:
    """In how many documents each n-gram occurs, for idf(g) = log N − log max(1, df(g))."""

    codes: torch.Tensor  # (G,) sorted n-gram codes
    counts: torch.Tensor  # (G,) float64 df
    documents: int  # N

    @classmethod
    def from_references(cls, refs: References) -> DocumentFrequency:
        owner, code, _ = ngrams(refs.tokens, refs.lengths, refs.base)
        image = refs.images.long()[owner]  # (E,) document of each entry
        codes, dense = torch.unique(code, return_inverse=True)  # (G,)
        seen = torch.unique(image * len(codes) + dense)  # distinct (document, n-gram)
        counts = torch.bincount(seen % len(codes), minlength=len(codes)).double()
        return cls(codes, counts, int(torch.unique(refs.images).numel()))

    def idf(self, codes: torch.Tensor) -> torch.Tensor:
        pos, found = _lookup(self.codes, codes)
        df = torch.where(found, self.counts[pos], torch.zeros((), dtype=torch.float64))
        return np.log(float(self.documents)) - df.clamp_min(1.0).log()


def cached_document_frequency(path: str, refs: References, salt: str = "") -> DocumentFrequency:
    """df of `refs`, read from `path` when it was made from the same references (and `salt`),
    else computed and written there atomically (a cache: an unwritable directory only warns)."""
    key = refs.fingerprint(salt)
    try:
        with np.load(path, allow_pickle=False) as z:
            if str(z["key"]) == key:
                return DocumentFrequency(
                    torch.from_numpy(z["codes"]), torch.from_numpy(z["counts"]), int(z["documents"])
                )
    except (OSError, KeyError, ValueError, zipfile.BadZipFile):
        pass  # missing, stale format or damaged: rebuilt below
    df = DocumentFrequency.from_references(refs)
    try:
        with atomic_path(path) as tmp:
            np.savez(
                tmp,
                key=np.array(key),
                codes=df.codes.numpy(),
                counts=df.counts.numpy(),
                documents=np.array(df.documents),
            )
    except OSError as e:
        log.info(f"could not cache CIDEr-D document frequencies in {path} ({e})")
    return df


class NgramScorer:
    """CIDEr-D and sentence BLEU-4 of candidate captions against fixed references, on ids."""

    def __init__(self, refs: References, df: DocumentFrequency, *, sigma: float = SIGMA):
        check_base(refs.base)
        self.base, self.sigma, self.df = refs.base, sigma, df
        # References grouped by image: image i owns captions first[i] .. first[i] + n_refs[i] - 1.
        order = torch.argsort(refs.images.long(), stable=True)
        images, lengths = refs.images.long()[order], refs.lengths.long()[order]
        self.n_refs = torch.bincount(images)  # (I,)
        self.first = torch.cumsum(self.n_refs, 0) - self.n_refs  # (I,)
        self.ref_words = lengths  # (C,)
        self.ref_bigrams = (lengths - 1).clamp_min(0).double()  # (C,)
        owner, code, count = ngrams(refs.tokens[order], lengths, self.base)  # (E,)
        # Every reference n-gram gets an id in one sorted table: entry key = caption·G + id.
        self.grams = torch.unique(code)  # (G,)
        gid = torch.searchsorted(self.grams, code)  # (E,)
        key = owner * len(self.grams) + gid
        sort = torch.argsort(key)
        self.ref_key, self.ref_count = key[sort], count[sort]  # (E,)
        weight = count * df.idf(code)  # (E,) v_r(g)
        norm2 = torch.zeros(len(lengths) * ORDERS, dtype=torch.float64)
        norm2.index_add_(0, owner * ORDERS + order_of(code, self.base), weight**2)
        self.ref_norm = norm2.sqrt().view(-1, ORDERS)  # (C, 4)

    def score(
        self, tokens: torch.Tensor, lengths: torch.Tensor, images: torch.Tensor, bleu: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """CIDEr-D (N,) float64, and coco-caption's per-sentence BLEU-4 (N,) when `bleu` else None, of each
        candidate against the references of its image (N,); ValueError where an image has no reference captions."""
        tokens, lengths, images = tokens.cpu(), lengths.cpu().long(), images.cpu().long()
        N = len(lengths)
        known_image = (images >= 0) & (images < len(self.n_refs))
        if not bool(known_image.all()) or bool((self.n_refs[images] == 0).any()):
            raise ValueError("a candidate's image has no reference captions")
        owner, code, count = ngrams(tokens, lengths, self.base)  # (E,)
        order = order_of(code, self.base)  # (E,)
        idf = self.df.idf(code)  # (E,)
        norm2 = torch.zeros(N * ORDERS, dtype=torch.float64).index_add_(0, owner * ORDERS + order, (count * idf) ** 2)
        norm = norm2.sqrt().view(N, ORDERS)  # (N, 4)
        # (candidate, reference) pairs: each candidate against every reference of its image.
        n_refs = self.n_refs[images]  # (N,)
        pair_c = torch.repeat_interleave(torch.arange(N), n_refs)  # (P,)
        pair_start = torch.cumsum(n_refs, 0) - n_refs  # (N,)
        pair_r = self.first[images][pair_c] + torch.arange(len(pair_c)) - pair_start[pair_c]  # (P,)
        # (entry, reference) pairs: each candidate n-gram looked up in each of those references.
        k = n_refs[owner]  # (E,)
        ent = torch.repeat_interleave(torch.arange(len(owner)), k)  # (Q,)
        pair = pair_start[owner][ent] + torch.arange(len(ent)) - (torch.cumsum(k, 0) - k)[ent]  # (Q,)
        gid, known = _lookup(self.grams, code)  # (E,)
        pos, hit = _lookup(self.ref_key, pair_r[pair] * len(self.grams) + gid[ent])  # (Q,)
        ref_count = torch.where(hit & known[ent], self.ref_count[pos], torch.zeros((), dtype=torch.float64))
        # Σ_g min(v_c, v_r) v_r = Σ_g min(tf_c, tf_r) tf_r idf² (idf ≥ 0), per pair and order.
        match = torch.minimum(count[ent], ref_count) * ref_count * idf[ent] ** 2  # (Q,)
        val = torch.zeros(len(pair_c) * ORDERS, dtype=torch.float64)
        val = val.index_add_(0, pair * ORDERS + order[ent], match).view(-1, ORDERS)  # (P, 4)
        denom = norm[pair_c] * self.ref_norm[pair_r]  # (P, 4)
        val = torch.where(denom > 0, val / denom.clamp_min(1e-300), val)
        delta = (lengths - 1).clamp_min(0).double()[pair_c] - self.ref_bigrams[pair_r]  # (P,)
        val = val * torch.exp(-(delta**2) / (2 * self.sigma**2)).unsqueeze(1)
        cider = torch.zeros(N, dtype=torch.float64).index_add_(0, pair_c, val.mean(1))
        cider = 10.0 * cider / n_refs
        if not bleu:
            return cider, None
        return cider, self._bleu4(lengths, owner, order, count, ent, ref_count, pair_c, pair_r)

    def _bleu4(self, lengths, owner, order, count, ent, ref_count, pair_c, pair_r) -> torch.Tensor:
        """coco-caption's per-sentence BLEU-4 from the matches `score` found."""
        N = len(lengths)
        # Counts clipped by the largest count in any one reference.
        most = torch.zeros(len(owner), dtype=torch.float64).scatter_reduce_(0, ent, ref_count, "amax")  # (E,)
        correct = torch.zeros(N * ORDERS, dtype=torch.float64)
        correct = correct.index_add_(0, owner * ORDERS + order, torch.minimum(count, most)).view(N, ORDERS)
        guess = (lengths.unsqueeze(1) - torch.arange(ORDERS)).clamp_min(0).double()  # (N, 4)
        # The reference length closest to the candidate's, the shorter on a tie.
        big = int(self.ref_words.max()) + 1
        gap = (self.ref_words[pair_r] - lengths[pair_c]).abs() * big + self.ref_words[pair_r]  # (P,)
        closest = torch.full((N,), torch.iinfo(torch.long).max).scatter_reduce_(0, pair_c, gap, "amin") % big
        precision = ((correct + _TINY) / (guess + _SMALL)).prod(1)  # (N,)
        ratio = (lengths.double() + _TINY) / (closest.double() + _SMALL)
        brevity = torch.where(ratio < 1, torch.exp(1 - 1 / ratio), torch.ones((), dtype=torch.float64))
        return precision**0.25 * brevity
