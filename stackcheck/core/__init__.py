"""The shapes that travel between stackcheck's parts: the cell (stackcheck.core.cell)."""
