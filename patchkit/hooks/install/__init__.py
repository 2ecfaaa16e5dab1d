"""How a patch goes on and comes off: the registry, all-or-nothing replacements, its state, routing."""
