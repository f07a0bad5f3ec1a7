"""The networks and how they are kept (checkpoints, exported models).

from captioner.models import AttentionDecoder
dec = AttentionDecoder(vocab_size=V, encoder_dim=512, embed_dim=512, hidden_dim=512,
                       attention_dim=512, dropout=0.5)
logits, alphas = dec(features, captions, lengths)   # (B, T-1, V), (B, T-1, L)
"""

__all__ = ["AttentionDecoder", "DecoderConfig", "EncoderSpec", "build_encoder"]


def __getattr__(name: str):
    # The networks load torch: imported when asked for, so that the vocabulary and the formats do not.
    if name in ("AttentionDecoder", "DecoderConfig"):
        from captioner.models import decoder

        return getattr(decoder, name)
    if name in ("EncoderSpec", "build_encoder"):
        from captioner.models import encoder

        return getattr(encoder, name)
    raise AttributeError(f"module 'captioner.models' has no attribute {name!r}")
