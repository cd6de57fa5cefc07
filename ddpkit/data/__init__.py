"""Data for N ranks: samplers, loaders, datasets and streams.

- ``loaders``: the training and validation loaders, built from the config (``data``).
- ``samplers`` / ``order``: training order sharded over ranks, resumable mid-epoch, index-free for
  huge sets (``data.order``); exact evaluation shards; per-sample seeded workers.
- ``elastic``: a training order independent of the world size (``data.global_batch_size``).
- ``epochs``: the Trainer's epoch protocol (start, agree on a length, iterate) over any loader.
- ``position``: the epoch's position in global samples, which a resume under any split of the same global batch finds.
- ``uneven``: ranks compare batch counts so uneven data errors or truncates instead of hanging (``data.uneven``).
- ``batched``: whole-batch reads from a ``TensorDataset`` (one gather per batch, the same batches).
- ``shared``: ``SharedDataset``, one read-only copy of in-memory data per host.
- ``datasets``: the built-in datasets (``digits`` and friends), registered by name; ``cache``: generated
  datasets built once per machine and read back from disk.
- ``tokens``: token files for language models (``data: {name: tokens}``), one ``os.pread`` per
  window, ids checked against the model's vocabulary; the built-in ``stdlib`` corpus; ``text_codec``: text
  to ids and back (bytes or a local ``tokenizer.json``), streamed, for generation.
- ``mixture`` / ``mixture_schedule``: several token files blended by weight (``data.kwargs.sources``), each
  global batch holding each source's share, in an index-free order that resumes at any world size.
- ``streaming`` / ``stream_epochs`` / ``stream_sources``: ``IterableDataset`` streams with equal
  step counts on every rank and exact resume; WebDataset and Hugging Face sources.
"""

# What the Trainer composes, importable from the package.
from ddpkit.data.epochs import data_position, epoch_batches, run_length, take_batches
from ddpkit.data.loaders import move_to_device, train_loader_for, val_loader_for
from ddpkit.data.mixture import consumed_tokens
from ddpkit.data.tokens import require_vocab_of

__all__ = [
    "data_position",
    "epoch_batches",
    "run_length",
    "take_batches",
    "move_to_device",
    "train_loader_for",
    "val_loader_for",
    "require_vocab_of",
    "consumed_tokens",
]
