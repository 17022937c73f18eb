"""spillover: tasks package."""
