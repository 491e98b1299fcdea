"""Data-parallel sync: the per-step average, DiLoCo and its overlapped outer sync."""
