"""Whether a forward is served: its plan (made once), the causes of stepping aside, the self-check."""
