"""The notebooks' figures, each a `matplotlib.figure.Figure` of its own (no pyplot state).

Attention heatmaps themselves are drawn by `captioner.serve.heatmaps`; these figures arrange captions,
statistics and training curves around them.
"""

from __future__ import annotations

import math
import os
import textwrap
from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import MaxNLocator

from captioner.data.images import load_image
from captioner.evaluation.metrics import attention_health, health_summary
from captioner.serve.api import Caption
from tools.lab.analysis import TrainingLog, attention_entropy, attention_stats, length_histogram
from tools.lab.recipes import SplitCaption

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple")


def captioned_images_figure(
    items: Sequence[tuple[object, Sequence[str]]], *, columns: int = 3, wrap: int = 40, title: str | None = None
) -> Figure:
    """Images with lines of text beneath each (captions, or "label: caption" to compare).

    Args:
        items: (image as path or PIL image, lines) pairs.
        wrap: characters per printed line; a wrapped line continues indented.
    """
    cols = max(1, min(columns, len(items)))
    rows = max(1, -(-len(items) // cols))
    wrapped = ["\n".join(textwrap.fill(line, wrap, subsequent_indent="   ") for line in lines) for _, lines in items]
    n_lines = [w.count("\n") + 1 for w in wrapped]
    # Each row of images gets a row of text as tall as its longest block, so text never overlaps.
    text_h = [0.17 * max(n_lines[r * cols : (r + 1) * cols], default=1) + 0.1 for r in range(rows)]
    img_h = 2.6
    fig = Figure(figsize=(3.6 * cols, img_h * rows + sum(text_h) + (0.4 if title else 0.0)))
    gs = fig.add_gridspec(2 * rows, cols, height_ratios=[h for r in range(rows) for h in (img_h, text_h[r])])
    for k, ((image, _), text) in enumerate(zip(items, wrapped)):
        r, c = divmod(k, cols)
        ax = fig.add_subplot(gs[2 * r, c])
        ax.imshow(load_image(image))
        ax.set_anchor("S")  # the image sits on its text
        ax.axis("off")
        tx = fig.add_subplot(gs[2 * r + 1, c])
        tx.axis("off")
        tx.text(0.0, 1.0, text, transform=tx.transAxes, ha="left", va="top", fontsize=9)
    if title:
        fig.suptitle(title)
    fig.tight_layout(h_pad=0.2)
    return fig


def entropy_figure(captions: Sequence[Caption | SplitCaption], titles: Sequence[str] | None = None) -> Figure:
    """Per caption, a bar per word: the entropy H of the attention map that produced it.

    The dashed line is log L, attention spread evenly over the grid; the number in each bar,
    e^H, reads as "about this many cells looked at".
    """
    captions = [getattr(c, "caption", c) for c in captions]
    longest = max((len(c.words) for c in captions), default=1)
    fig = Figure(figsize=(max(6.0, 0.9 * longest + 1.5), 1.9 * max(1, len(captions)) + 0.5))
    axes = fig.subplots(max(1, len(captions)), 1, squeeze=False)[:, 0]
    for k, (ax, c) in enumerate(zip(axes, captions)):
        h = attention_entropy(c.attention) if len(c.words) else np.zeros(0)  # (n,)
        L = int(np.prod(c.attention.shape[1:])) if c.attention.ndim > 1 else 1
        bars = ax.bar(range(len(h)), h, width=0.7, color="tab:blue", label="entropy H of the word's map")
        ax.bar_label(bars, [f"≈{math.exp(v):.0f}" for v in h], label_type="center", color="white", fontsize=8)
        ax.axhline(math.log(L), ls="--", c="gray", lw=1, label=f"log L: even over all {L} cells")
        ax.set_xticks(range(len(h)), c.words)
        ax.set_xlim(-0.5, longest - 0.5)  # same bar width in every panel
        ax.set_ylim(0, math.log(L) * 1.15)
        ax.set_ylabel("H (nats)")
        ax.set_title(titles[k] if titles else c.text, fontsize=10)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles, labels, loc="upper right", fontsize=8, title="number in bar: e^H ≈ cells looked at", title_fontsize=8
    )
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.45 / fig.get_figheight()))
    return fig


def training_figure(log: TrainingLog, title: str | None = None) -> Figure:
    """Loss (self-critical runs: the reward), BLEU-4, CIDEr and the learning rate of a run, against epochs."""
    ep = log.per_epoch()
    fig = Figure(figsize=(11, 6.5))
    (ax_loss, ax_bleu), (ax_cider, ax_lr) = fig.subplots(2, 2, sharex=True)
    if log.objective == "scst":
        _reward_panel(ax_loss, log, ep)
    else:
        if log.train:
            ax_loss.plot(log.train["epoch"], log.train["loss"], c="tab:blue", alpha=0.35, lw=1, label="logged steps")
        ax_loss.plot(ep["epoch"], ep["loss"], "o-", c="tab:blue", label="mean since last validation")
        # Hard attention's loss is a REINFORCE surrogate; the word NLL is the comparable part.
        if np.isfinite(ep["nll"]).any() and not np.allclose(ep["nll"], ep["loss"], equal_nan=True, rtol=1e-3):
            ax_loss.plot(ep["epoch"], ep["nll"], "s--", c="tab:cyan", label="of which word NLL")
        ax_loss.set(title="training loss (per word)", ylabel="loss")
        ax_loss.legend(fontsize=8)
    for ax, key in ((ax_bleu, "BLEU-4"), (ax_cider, "CIDEr")):
        ax.plot(ep["epoch"], ep[key], "o-", c="tab:green")
        best = int(np.argmax(ep[key]))
        ax.plot(ep["epoch"][best], ep[key][best], "*", ms=14, c="tab:red", label=f"best {ep[key][best]:.3f}")
        ax.set(title=f"validation {key} (generated captions)", ylabel=key)
        ax.legend(fontsize=8)
    if log.train:
        ax_lr.step(log.train["epoch"], log.train["lr"], where="post", c="tab:purple")
    ax_lr.plot(log.val["epoch"], log.val["lr"], "o", c="tab:purple", ms=4, label="after each validation")
    ax_lr.set(title="learning rate", ylabel="lr", yscale="log")
    ax_lr.legend(fontsize=8)
    for ax in (ax_cider, ax_lr):
        ax.set_xlabel("epoch")
    fig.suptitle(title or os.path.basename(os.path.dirname(os.path.abspath(log.path))))
    fig.tight_layout()
    return fig


def _reward_panel(ax, log: TrainingLog, ep: dict) -> None:
    """Self-critical training: its loss is a REINFORCE surrogate, so show what it raises, the
    sampled captions' mean reward (CIDEr-D against the training references), and the baseline."""
    if log.train:
        ax.plot(log.train["epoch"], log.train["reward"], c="tab:blue", alpha=0.35, lw=1, label="logged steps")
        ax.plot(log.train["epoch"], log.train["baseline"], c="tab:orange", alpha=0.6, lw=1, label="baseline")
    ax.plot(ep["epoch"], ep["reward"], "o-", c="tab:blue", label="mean since last validation")
    ax.set(title="reward of sampled captions (CIDEr-D, training references)", ylabel="reward")
    ax.legend(fontsize=8)


def model_comparison_figure(
    metrics: Mapping[str, Mapping], captions: Mapping[str, Sequence[Caption | SplitCaption]]
) -> Figure:
    """Models side by side: caption scores, attention sharpness, pointing accuracy.

    Args:
        metrics: model name → `evaluate` output (with grounding).
        captions: model name → its captions (with attention) of the same images.
    """
    names = list(metrics)
    fig = Figure(figsize=(13, 3.4))
    ax_q, ax_h, ax_p, ax_g = fig.subplots(1, 4)
    _scores_panel(ax_q, metrics, names)
    _attention_panels(ax_h, ax_p, captions, names)
    _pointing_panel(ax_g, metrics, names)
    fig.tight_layout()
    return fig


def _scores_panel(ax_q, metrics: Mapping[str, Mapping], names: list[str]) -> None:
    """BLEU-4 and CIDEr of each model, as grouped bars."""
    width = 0.8 / len(names)
    for k, name in enumerate(names):
        x = np.arange(2) + (k - (len(names) - 1) / 2) * width
        vals = [metrics[name]["BLEU-4"], metrics[name]["CIDEr"]]
        ax_q.bar_label(ax_q.bar(x, vals, width, color=COLORS[k], label=name), fmt="%.2f", fontsize=8)
    ax_q.set_xticks(range(2), ["BLEU-4", "CIDEr"])
    ax_q.set_title("caption quality (test)")
    ax_q.legend(fontsize=8)


def _attention_panels(ax_h, ax_p, captions: Mapping[str, Sequence], names: list[str]) -> None:
    """Histograms of each model's attention entropy and top-cell weight per word."""
    stats = {n: attention_stats(captions[n]) for n in names}
    for ax, key, title, xlabel in (
        (ax_h, "entropy", "attention entropy per word", "entropy / log L"),
        (ax_p, "peak", "weight on the top cell", "max α"),
    ):
        for k, name in enumerate(names):
            # Clipped: an even map's entropy can round to a hair above 1 and fall off the last bin.
            ax.hist(
                np.clip(stats[name][key], 0, 1),
                bins=np.linspace(0, 1, 21),
                histtype="step",
                lw=2,
                color=COLORS[k],
                density=True,
                label=f"{name} (median {np.median(stats[name][key]):.2f})" if len(stats[name][key]) else name,
            )
        ax.set(title=title, xlabel=xlabel, ylabel="density")
        ax.legend(fontsize=8)


def _pointing_panel(ax_g, metrics: Mapping[str, Mapping], names: list[str]) -> None:
    """Each model's pointing accuracy as a bar, with its chance rate as a dashed line."""
    for k, name in enumerate(names):
        g = metrics[name].get("grounding") or {}
        p = g.get("pointing")
        ax_g.bar(k, p or 0.0, 0.6, color=COLORS[k])
        top = max(p or 0.0, g.get("chance") or 0.0)
        ax_g.text(
            k,
            top + 0.02,
            f"{p:.2f} of {g.get('words', 0)} words" if p is not None else "n/a",
            ha="center",
            va="bottom",
            fontsize=8,
        )
        if g.get("chance") is not None:
            ax_g.hlines(
                g["chance"], k - 0.3, k + 0.3, colors="black", linestyles="--", label="chance" if k == 0 else None
            )
    ax_g.set_xticks(range(len(names)), names)
    ax_g.set(title="pointing accuracy", ylim=(0, 1.1))
    if ax_g.get_legend_handles_labels()[0]:
        ax_g.legend(fontsize=8)


def dataset_figure(
    lengths: np.ndarray, coverage: Mapping[str, np.ndarray], *, max_len: int | None = None, min_count: int | None = None
) -> Figure:
    """Caption lengths, and what each minimum word count keeps of the vocabulary.

    Args:
        max_len: the training length limit, drawn as a line.
        min_count: the chosen minimum count, drawn as a line.
    """
    fig = Figure(figsize=(12, 3.8))
    ax_len, ax_cov = fig.subplots(1, 2)
    values, counts = length_histogram(lengths)
    ax_len.bar(values, counts, width=0.9, color="tab:blue")
    ax_len.set(
        title=f"caption length ({len(lengths)} captions, median {np.median(lengths):.0f} words)",
        xlabel="words",
        ylabel="captions",
    )
    if max_len is not None:
        share = float((np.asarray(lengths) > max_len).mean())
        ax_len.axvline(max_len + 0.5, c="tab:red", ls="--", label=f"max_len {max_len}: {share:.1%} left out")
        ax_len.legend(fontsize=8)
    m = coverage["min_count"]
    ax_cov.plot(m, 100 * coverage["tokens"], "o-", c="tab:green", label="word occurrences covered")
    ax_cov.plot(m, 100 * coverage["captions"], "s-", c="tab:olive", label="captions without <unk>")
    low = min(float(coverage["tokens"].min()), float(coverage["captions"].min())) * 100
    # At least a 10-point range: a 0.5% change should not look like a cliff.
    ax_cov.set(
        title="vocabulary vs minimum count",
        xlabel="minimum count",
        ylabel="% kept",
        ylim=(min(90.0, math.floor(low) - 1), 100.5),
    )
    ax_words = ax_cov.twinx()
    ax_words.plot(m, coverage["words"], "^--", c="tab:purple", label="vocabulary size")
    ax_words.set_ylim(0, max(1, int(coverage["words"].max())) * 1.05)
    ax_words.set_ylabel("words in vocabulary", color="tab:purple")
    for ax in (ax_len, ax_cov):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if min_count is not None:
        ax_cov.axvline(min_count, c="gray", ls=":", label=f"min_count {min_count}")
    h1, l1 = ax_cov.get_legend_handles_labels()
    h2, l2 = ax_words.get_legend_handles_labels()
    ax_cov.legend(h1 + h2, l1 + l2, fontsize=8, loc="lower left")
    fig.tight_layout()
    return fig


def peak_figure(captions: Sequence[Caption | SplitCaption], title: str | None = None) -> Figure:
    """Where the words' attention peaks land on the grid, over many captions, with the health figures.

    A model whose maps follow the objects spreads its peaks over the grid, as the objects are
    spread; one that parks its attention piles them on a few cells, often on the border ring
    (outlined), whatever the image.
    """
    captions = [getattr(c, "caption", c) for c in captions]
    maps = [c.attention for c in captions if len(c.words)]
    g = maps[0].shape[-1] if maps else 14
    counts = np.zeros((g, g))
    for a in maps:
        np.add.at(counts, np.unravel_index(a.reshape(len(a), -1).argmax(1), (g, g)), 1)  # (g, g) peaks per cell
    fig = Figure(figsize=(5.2, 5.0))
    ax = fig.subplots()
    im = ax.imshow(counts / max(1, counts.sum()), cmap="viridis")
    ax.add_patch(Rectangle((-0.5, -0.5), g, g, fill=False, ec="white", lw=3, ls="--"))  # the border ring
    fig.colorbar(im, ax=ax, fraction=0.046, label="share of all words' peaks")
    ax.set(xticks=[], yticks=[])
    health = attention_health(maps)
    ax.set_title("\n".join(textwrap.wrap(title or health_summary(health), 60)), fontsize=9)
    fig.tight_layout()
    return fig
