"""How a model is split over ranks: the tensor plan, the pipeline's cut, activation checkpointing.

- ``tensor_plan``: tensor parallelism's plans of ddpkit's ``gpt`` and ``llama`` (torch's ParallelStyles by
  module name), the degrees they take, the plan applied;
- ``pipeline_split``: a model cut into pipeline stages (by module names or a model's own cut), the parts a
  rank holds;
- ``activation_checkpointing``: blocks that recompute their activations (``train.activation_checkpointing``).
"""
