"""dhisparse."""
