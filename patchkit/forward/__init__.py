"""The forward's data path: mask -> metadata once -> varlen kernel -> repad, and decode on the cache."""
