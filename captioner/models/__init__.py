"""The networks and how they are kept: the VGG encoder, the attention decoder, decoding, the
vocabulary, and the checkpoint and exported-model formats.

    from captioner.models import AttentionDecoder, DecoderConfig
    dec = AttentionDecoder(vocab_size=V, encoder_dim=512, embed_dim=512, hidden_dim=512,
                           attention_dim=512, dropout=0.5)
    logits, alphas = dec(features, captions, lengths)   # (B, T-1, V), (B, T-1, L)
"""

from captioner.models.decode import Hypothesis, beam_search
from captioner.models.decoder import AttentionDecoder, DecoderConfig
from captioner.models.encoder import EncoderSpec, build_encoder

__all__ = ["AttentionDecoder", "DecoderConfig", "EncoderSpec", "Hypothesis", "beam_search", "build_encoder"]
