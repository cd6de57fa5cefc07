"""Data for N ranks: samplers, loaders, datasets and streams.

- ``loaders``: the training and validation loaders, built from the config (``data``).
- ``samplers`` / ``order``: training order sharded over ranks, resumable mid-epoch, index-free for
  huge sets (``data.order``); exact evaluation shards; per-sample seeded workers.
- ``elastic``: a training order independent of the world size (``data.global_batch_size``).
- ``epochs``: the Trainer's epoch protocol (start, agree on a length, iterate) over any loader.
- ``uneven``: ranks compare batch counts so uneven data errors or truncates instead of hanging (``data.uneven``).
- ``batched``: whole-batch reads from a ``TensorDataset`` (one gather per batch, the same batches).
- ``shared``: ``SharedDataset``, one read-only copy of in-memory data per host.
- ``datasets``: the built-in datasets (``digits`` and friends), registered by name.
- ``streaming`` / ``stream_epochs`` / ``stream_sources``: ``IterableDataset`` streams with equal
  step counts on every rank and exact resume; WebDataset and Hugging Face sources.
"""
