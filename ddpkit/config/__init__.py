"""The run's configuration: a typed schema, read strictly from YAML and ``key=value`` overrides.

    from ddpkit.config import load_config
    cfg = load_config("configs/quickstart.yaml", ["optim.lr=3e-4"])

- ``schema`` / ``train_sections`` / ``health_section`` / ``profile_section`` / ``sample_section`` / ``parallel`` /
  ``lora_section``: the frozen dataclasses, one documented field each (``fields``).
- ``yaml_text``: safe YAML reading and writing; ``overrides``: ``dotted.key=value``.
- ``loader``: raw input -> a validated :class:`Config` (unknown keys get the closest valid one).
- ``layout``: the parallel layout's degrees (pipeline stages, microbatches) checked against the world size before
  any process group exists.
- ``split``: how a run splits its global batch (replicas, loader batches per step): what a resume may change.
- ``checks``: rules that span several fields; ``serialize``: dicts, YAML text, the config hash.
- ``urls``: which values are object-storage URLs (``checkpoint.dir: s3://...``), and their checks.
- ``json_schema``: the config as a JSON Schema, for editors (``ddpkit config --schema``); ``cli_args``: the
  command line's one style (CONFIG positional, old spellings with a deprecation line, plain ``--help``).

Nothing here knows about ``torch.distributed``.
"""

from ddpkit.config.loader import load_config
from ddpkit.config.schema import Config
from ddpkit.config.serialize import dump_config

__all__ = ["Config", "load_config", "dump_config"]
