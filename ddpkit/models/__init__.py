"""What a network is: ddpkit's own models and what comes with them.

- ``builtin``: the built-in models registered by name (``mnist_cnn``, ``mlp``, and ``gpt`` through it);
- ``gpt``: a GPT language model (``model: {name: gpt}``) with a KV cache; ``llama``: the Llama family in the
  same builder (``arch: llama``: RMSNorm, ``rope``, SwiGLU, grouped-query ``attention`` and its cache, shared
  with ``gpt``); ``document_mask``: attention inside each document of a packed window;
- ``generation``: greedy / temperature / top-k / top-p sampling and the protocol a model follows to be sampled;
- ``hf_gpt2`` / ``hf_llama`` (on ``hf_files``): Hugging Face directories in (``init_from``) and out
  (``ddpkit export --format hf``); ``hf_slices``: their weights read a held part at a time, each rank only the
  tensors and slices it holds;
- ``lora``: ``model.lora``'s adapter on a frozen base, checkpoints of the adapter (``lora_peft``: through peft;
  ``lora_tensor``: the adapters split with their base layer's tensor plan; ``lora_fingerprint``: the base's
  fingerprint, by its source for ddpkit's own models so the base can be built on the meta device);
- ``init_by_name``: each parameter drawn from a generator seeded by its name: the same initial weights in every
  layout, for the whole model or any part of it (``GPT.init_weights(parts)``, ``Llama.init_weights(parts)``);
- ``tensor_plans``: each family's tensor plan (``GPT.tensor_plan``, ``Llama.tensor_plan``); its pipeline cut is
  on the class too (``stage_parts``, ``stage_input``, ``stage_rotation``, ``stage_output``);
  ``vocab_embedding``: the plans' vocabulary-sharded embedding, whose backward makes only the rank's rows;
  ``vocab_head``: their vocabulary-sharded head;
- ``accumulate_in_place``: the embedding's and the head's micro-batch gradients added into ``.grad`` in place, with
  autograd's bits (no second vocabulary matrix beside the accumulated one).

Applying a plan or a cut, and how the ranks hold the parts, lives in :mod:`ddpkit.parallel`.
"""
