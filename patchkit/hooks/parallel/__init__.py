"""Sequence parallelism (Ulysses, context parallel): patchkit's attention inside their all-to-alls."""
