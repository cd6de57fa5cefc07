"""How a model is split over ranks, held by them and wrapped: ``parallelize`` and what it is made of.

- ``parallelize``: the one placement function, in one order (tensor plan, pipeline cut or the whole model, then each
  part's activation checkpointing, data-parallel wrapper and compile), returning one value (``Placed``);
- ``meta_build``: the model built on the meta device, then each part made and initialised only where a rank
  holds it;
- ``layout``: the run's layout as one value (dp, pp, tp degrees, this rank's coordinates, one DeviceMesh, and the
  data-parallel way chosen from ``parallel.mode``);
- ``data_parallel`` / ``fsdp``: the ways replicas hold parameters, one class each (``DDP``, ``Zero1``, ``FSDP2``):
  wrap, shard the optimizer, skip gradient sync, gather full parameters, bytes a rank keeps;
- ``fsdp_vocabulary``: ``parallel.fsdp.shard_vocabulary``, a language model's embedding and head split by
  vocabulary rows over fsdp2's ranks, outside FSDP2's units (activations move instead of whole matrices);
- ``gloo_collectives``: FSDP2's all-gather and reduce-scatter on Gloo without Gloo's whole-size staging copies;
- ``tensor_plan``: tensor parallelism's plans of ddpkit's ``gpt`` and ``llama`` (torch's ParallelStyles by
  module name), the degrees they take, the plan applied;
- ``pipeline_split``: a model cut into pipeline stages (by module names or a model's own cut), the parts a
  rank holds; ``pipeline``: this rank's stages wrapped, torch's stages and schedule; ``pipeline_forward``: the
  forward-only pass through the stages that validation runs;
- ``model_views``: the model as the loop sees it (wrapped and compiled for training, bare for evaluation and
  saving) and ``train.compile``'s watch; ``block_compile``: ``train.compile`` block by block, before the sharding,
  under fsdp2 and inside pipeline stages;
- ``activation_checkpointing``: blocks that recompute their activations (``train.activation_checkpointing``).
"""
