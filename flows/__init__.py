"""spillover: flows package."""
