"""Scoring: rule rewards, reward models, eval."""
