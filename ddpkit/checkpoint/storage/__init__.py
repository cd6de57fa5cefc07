"""Checkpoints, metrics and the run lock on object storage (S3, GCS, Azure, ``file://``), through fsspec.

    checkpoint:
      dir: s3://my-bucket/runs/gpt2       # ddpkit[s3]; gs:// ddpkit[gcs]; az:// or abfs:// ddpkit[azure]
      storage_options: {profile: train}   # optional; credentials otherwise from the cloud's environment

Saves go to ``<output_dir>/checkpoints`` first, as always, then a background process uploads them;
the same command on an empty disk resumes from the newest valid checkpoint in the bucket. The modules,
in the order a run meets them (docs/storage.md has the layout, the guarantees and their limits):

    store.py     one URL through fsspec: put/get/list/delete, create-only writes, a client rebuilt on demand
    probe.py     at start, from every node: write, read, delete, and whether create-only is honoured
    layout.py    data objects + a manifest written last; the newest valid one; download with sha256; retention
    lease.py     the run lock on the store: a lease with fencing epochs
    publish.py   one checkpoint's upload (sharded ones in parts, one per node)
    worker.py    the upload process: in order, retries with backoff, lock renewal
    uploads.py   the training process's handle on it
    mirror.py    RemoteMirror: what the checkpointer calls (for_run, fetch, saved, protect, metrics, on_exit)
"""

from ddpkit.checkpoint.storage.mirror import EXIT_DEADLINE_S, RemoteMirror

__all__ = ["RemoteMirror", "EXIT_DEADLINE_S"]
