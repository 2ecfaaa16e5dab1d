"""Per-model patch modules, installed as `patchkit.patches`; each declares one `SPEC` for the registry."""
