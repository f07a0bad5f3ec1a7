"""The decoder of sgrvinod's "a-PyTorch-Tutorial-to-Image-Captioning" (models.py), restated as the
benchmark's baseline: the same computation, written here so the benchmark needs no download.
Given the path of the tutorial's own models.py, the benchmark also times that code, run as the
tutorial's train.py runs it (`load_tutorial_models`, `tutorial_train_step`).

What makes it the baseline: at every time step it re-projects all L annotation vectors
through the attention's encoder layer (B_t·L·D·A multiply-adds per step, where our decoder
does that once per image), sorts the batch by length and shrinks it as captions end, gates
with a D-wide sigmoid, and applies the output layer per step.
"""

from __future__ import annotations

import torch
from torch import nn


class TutorialAttention(nn.Module):
    def __init__(self, encoder_dim: int, decoder_dim: int, attention_dim: int):
        super().__init__()
        self.encoder_att = nn.Linear(encoder_dim, attention_dim)
        self.decoder_att = nn.Linear(decoder_dim, attention_dim)
        self.full_att = nn.Linear(attention_dim, 1)

    def forward(self, encoder_out, h):
        att1 = self.encoder_att(encoder_out)  # (B_t, L, A), every step
        att2 = self.decoder_att(h)  # (B_t, A)
        att = self.full_att(torch.relu(att1 + att2.unsqueeze(1))).squeeze(2)  # (B_t, L)
        alpha = att.softmax(dim=1)  # (B_t, L)
        return (encoder_out * alpha.unsqueeze(2)).sum(dim=1), alpha  # (B_t, D), (B_t, L)


class TutorialDecoder(nn.Module):
    def __init__(
        self,
        attention_dim: int,
        embed_dim: int,
        decoder_dim: int,
        vocab_size: int,
        encoder_dim: int = 512,
        dropout: float = 0.5,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.attention = TutorialAttention(encoder_dim, decoder_dim, attention_dim)
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.dropout = nn.Dropout(p=dropout)
        self.decode_step = nn.LSTMCell(embed_dim + encoder_dim, decoder_dim)
        self.init_h = nn.Linear(encoder_dim, decoder_dim)
        self.init_c = nn.Linear(encoder_dim, decoder_dim)
        self.f_beta = nn.Linear(decoder_dim, encoder_dim)
        self.fc = nn.Linear(decoder_dim, vocab_size)

    def forward(self, encoder_out, captions, lengths):
        B, L, _ = encoder_out.shape
        lengths, order = lengths.sort(descending=True)
        encoder_out, captions = encoder_out[order], captions[order]
        embeddings = self.embedding(captions)
        mean = encoder_out.mean(dim=1)
        h, c = self.init_h(mean), self.init_c(mean)
        decode_lengths = (lengths - 1).tolist()
        T = max(decode_lengths)
        predictions = encoder_out.new_zeros(B, T, self.vocab_size)
        alphas = encoder_out.new_zeros(B, T, L)
        for t in range(T):
            bt = sum(n > t for n in decode_lengths)
            awe, alpha = self.attention(encoder_out[:bt], h[:bt])
            awe = torch.sigmoid(self.f_beta(h[:bt])) * awe
            h, c = self.decode_step(torch.cat([embeddings[:bt, t], awe], dim=1), (h[:bt], c[:bt]))
            predictions[:bt, t] = self.fc(self.dropout(h))
            alphas[:bt, t] = alpha
        return predictions, captions, decode_lengths, alphas, order


def tutorial_loss(model, features, captions, lengths, alpha_c: float = 1.0):
    """The tutorial's train.py loss: cross-entropy on packed targets + doubly stochastic penalty."""
    from torch.nn.utils.rnn import pack_padded_sequence

    scores, caps_sorted, decode_lengths, alphas, _ = model(features, captions, lengths)
    targets = caps_sorted[:, 1:]
    scores = pack_padded_sequence(scores, decode_lengths, batch_first=True).data
    targets = pack_padded_sequence(targets, decode_lengths, batch_first=True).data
    loss = nn.functional.cross_entropy(scores, targets)
    return loss + alpha_c * ((1.0 - alphas.sum(dim=1)) ** 2).mean()


# the original code, when the user has it


def load_tutorial_models(path: str):
    """Import the tutorial's own `models.py` from a path (it is not copied into this repository).

    Get it with `git clone https://github.com/sgrvinod/a-PyTorch-Tutorial-to-Image-Captioning`.
    Its module-level `device` is set to the device the benchmark runs on.
    """
    import importlib.util
    import os

    if not os.path.isfile(path):
        raise SystemExit(f"--tutorial-models {path}: no such file (the tutorial's models.py)")
    spec = importlib.util.spec_from_file_location("sgrvinod_models", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "DecoderWithAttention"):
        raise SystemExit(f"--tutorial-models {path}: no DecoderWithAttention in it")
    return module


def tutorial_train_step(
    module,
    features,
    captions,
    lengths,
    vocab_size: int,
    device,
    grad_clip: float = 5.0,
    alpha_c: float = 1.0,
    lr: float = 4e-4,
):
    """One training step of the tutorial's DecoderWithAttention as its train.py runs it: forward,
    packed cross-entropy plus the doubly stochastic penalty, backward, `clip_gradient` (clamp
    each gradient to ±grad_clip), Adam."""
    from torch.nn.utils.rnn import pack_padded_sequence

    module.device = device
    torch.manual_seed(0)
    decoder = (
        module.DecoderWithAttention(
            attention_dim=512,
            embed_dim=512,
            decoder_dim=512,
            vocab_size=vocab_size,
            encoder_dim=features.size(-1),
            dropout=0.5,
        )
        .to(device)
        .train()
    )
    optimizer = torch.optim.Adam(decoder.parameters(), lr=lr)
    criterion = nn.CrossEntropyLoss()
    caplens = lengths.unsqueeze(1)  # (B, 1), as its dataset gives

    def step():
        scores, caps_sorted, decode_lengths, alphas, _ = decoder(features, captions, caplens)
        targets = caps_sorted[:, 1:]
        scores = pack_padded_sequence(scores, decode_lengths, batch_first=True).data
        targets = pack_padded_sequence(targets, decode_lengths, batch_first=True).data
        loss = criterion(scores, targets) + alpha_c * ((1.0 - alphas.sum(dim=1)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        for group in optimizer.param_groups:  # its utils.clip_gradient
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.data.clamp_(-grad_clip, grad_clip)
        optimizer.step()

    return step
