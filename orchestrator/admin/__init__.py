"""The operator's admin page: its routes, its view of the slots, its live attention feed."""
