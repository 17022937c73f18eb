"""spillover: infra package."""
