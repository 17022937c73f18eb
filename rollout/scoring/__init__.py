"""Scoring: rule rewards and reward models."""
