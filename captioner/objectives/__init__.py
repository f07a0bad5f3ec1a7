"""Training objectives: a loss is a sum of terms."""
