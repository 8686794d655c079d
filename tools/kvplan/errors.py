"""The planner's one error type: bad input, naming the field (the CLI prints it and exits 2)."""
from __future__ import annotations

class PlannerInputError(ValueError):
    """Bad planner input; ``field`` names the offending input."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message
