"""The networks and how they are kept (checkpoints, exported models)."""

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
