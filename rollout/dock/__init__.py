"""The transfer dock: every sample of the current and the next global batch, with partial rollout."""
