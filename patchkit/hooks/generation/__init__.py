"""The caches generate() brings: static-cache masks read back as padding, the cache a packed forward fills."""
