"""Entry points besides apply_patch: the env-var autostart, the CLI, doctor, verify, configuration."""
