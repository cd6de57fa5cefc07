"""Data for N ranks: samplers, loaders, datasets and streams.

- ``loaders``: training order sharded over ranks, exact evaluation, resumable epochs, seeded workers.
- ``elastic``: a training order independent of the world size (``data.global_batch_size``).
- ``datasets``: the built-in datasets (``digits`` and friends), registered by name.
- ``streaming`` / ``stream_epochs`` / ``stream_sources``: ``IterableDataset`` streams with equal
  step counts on every rank and exact resume; WebDataset and Hugging Face sources.
"""
