"""Attention correctness (Liu et al., "Attention Correctness in Neural Image Captioning", AAAI 2017):
where a dataset has object boxes, a word that names a boxed object should look at it.

For each such word, −log Σ_{i in the object's cells} α_ti: the attention the map gives the
object's cells, as a likelihood. `fit --boxes INSTANCES_JSON` adds it to the objective, per word,
for the training images' boxes only (`data.boxes.BoxTargets` says which words and cells).

On the dataset's words alone the term cannot make a map commit where the next object is the
caption's choice: captions name a scene's objects in either order, so under teacher forcing the
map drawn before "yellow" in "a yellow triangle and a purple square" pays least split between
the two objects, and the word is then read from a blend of both. The same term at the word the
model itself would write at each step (its most likely word there, `BoxTargets.for_predictions`)
asks that map to lie on the object of the model's own choice, so that the choice and the map agree.
Symbols: E (caption, step) pairs with a target, L locations.
"""

from __future__ import annotations

import torch

LOG_EPS = 1e-12


def attention_correctness(
    alphas: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor, masks: torch.Tensor, words
) -> torch.Tensor:
    """λ's multiplicand per word: Σ over the targets of −log (attention on the object's cells).

    Args:
        alphas: (B, T-1, L) the pass's maps.
        rows, steps: (E,) the captions and steps whose word names a boxed object.
        masks: (E, L) bool, the cells of those objects.
        words: what to divide the batch total by.
    """
    on_object = (alphas[rows, steps].float() * masks).sum(-1)  # (E,)
    return -on_object.clamp_min(LOG_EPS).log().sum() / words
