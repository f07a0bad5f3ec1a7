"""Training: `prepare` (the feature cache), `fit` (config, run set-up, the step, the loop), encoder
fine-tuning, torchrun, and surviving faults."""
