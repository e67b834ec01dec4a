"""Tile scheduling for packed variable-length documents (installed as flamia_cute.schedules)."""
