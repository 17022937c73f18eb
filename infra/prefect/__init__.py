"""Prefect process settings and its ephemeral server for a training process."""
