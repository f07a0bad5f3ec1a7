"""The networks and how they are kept: the encoder's backbones, the attention decoder, the
vocabulary, the familiarity statistics a model carries, and the checkpoint and exported-model
formats with the places they are read from.

    from captioner.models import AttentionDecoder, DecoderConfig
    dec = AttentionDecoder(vocab_size=V, encoder_dim=512, embed_dim=512, hidden_dim=512,
                           attention_dim=512, dropout=0.5)
    logits, alphas = dec(features, captions, lengths)   # (B, T-1, V), (B, T-1, L)
"""

from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.models.encoder import EncoderSpec, build_encoder

__all__ = ["AttentionDecoder", "DecoderConfig", "EncoderSpec", "build_encoder"]
