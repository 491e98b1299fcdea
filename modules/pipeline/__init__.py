"""The pipeline: the GPipe schedule between stages and what crosses a pipeline link."""
