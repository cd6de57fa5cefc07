"""Commands that read finished runs or plan one.

- ``runs``: ``ddpkit runs``, a table of the runs under a directory.
- ``plot``: ``ddpkit plot``, loss and metric curves of one or more runs.
- ``goodput``: ``ddpkit goodput``, where a run's wall time went (reads :mod:`ddpkit.goodput`).
- ``estimate``: ``ddpkit estimate``, bytes per rank of each ``parallel.mode``, before a run.
- ``tokenize``: ``ddpkit tokenize``, text files to a token file for ``data: {name: tokens}``.
- ``chat``: ``ddpkit tokenize --chat``, chat or prompt/completion lines to tokens and a mask file (trained tokens);
  ``chat_template``: a model's own chat template, its end-of-turn token, and the ids a chat stops at.
- ``export``: ``ddpkit export``, a checkpoint's model weights as safetensors or a torch state_dict;
  ``hf_export``: ``ddpkit export --format hf`` (a ``gpt`` model as a Hugging Face directory; ``--merge``: LoRA
  merged) and ``--format peft`` (a LoRA adapter as peft's files);
  ``lm_source``: a run's or checkpoint's model rebuilt with its trained weights (for export and generate).
- ``generate``: ``ddpkit generate``, text sampled from a trained language model, streamed as it comes.
- ``env_report``: ``ddpkit env``, versions, devices, variables and extras for a bug report.
"""
