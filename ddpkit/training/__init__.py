"""What one training step is made of, apart from the loop itself.

- ``optim``: optimizers and learning-rate schedules, registered by name; ``param_groups``: weight decay on
  matrices only and ``optim.groups`` (per-group ``lr`` / ``weight_decay`` by parameter-name patterns).
- ``precision``: autocast and the fp16 gradient scaler.
- ``allocator``: host memory kept between steps (``train.keep_host_memory``).
- ``samples``: ``train.sample``'s listener, text sampled while training (log, ``samples.jsonl``, TensorBoard).
- ``metrics``: exact validation means over ranks, the best-metric tracker; ``early_stopping``: its listener;
  ``evaluation``: the loop's validations (exact metrics, watchdog progress, the bare model);
  ``evaluation_pipeline``: under a pipeline, each batch forward through the stages, the metrics on the last.
- ``steps``: the built-in training and validation steps (classifiers, and language models' per-token
  loss); ``token_loss``: ``train.loss_normalization: tokens``, exact for any split of a global batch.
- ``health`` / ``health_checks`` / ``straggler`` / ``replicas``: training health: non-finite
  losses and gradients, loss spikes, slow ranks, replicas that drifted apart.
- ``footprint``: what each rank of a layout will hold (``ddpkit estimate``'s numbers), and the refusal of a layout
  whose largest rank cannot hold it, before the model is made.
- ``rng``: seeding, and capturing / restoring every generator.
- ``train_step``: the loop's step object (one optimizer step of the batches it takes): accumulation;
  ``pipeline_step``: a pipeline schedule as the step, over a model cut into stages (:mod:`ddpkit.parallel`);
  ``step_builder``: which of the two a run trains with.

The models themselves live in :mod:`ddpkit.models`; where a rank's part of one lives, how the replicas hold it and
how it is wrapped and compiled, in :mod:`ddpkit.parallel` (``parallelize``).
"""

# What the Trainer composes, importable from the package.
# The built-in steps, as training.steps.*
from ddpkit.models.lora import apply_lora
from ddpkit.training import steps
from ddpkit.training.early_stopping import EarlyStopping
from ddpkit.training.evaluation import Evaluation
from ddpkit.training.footprint import refuse_what_cannot_fit
from ddpkit.training.health import TrainingHealth
from ddpkit.training.health_checks import watched
from ddpkit.training.metrics import evaluate
from ddpkit.training.optim import OptimizerStep, build_optimizer, build_scheduler
from ddpkit.training.param_groups import optimizer_order
from ddpkit.training.rng import RngStreams, seed_for_setup
from ddpkit.training.samples import TrainingSamples
from ddpkit.training.step_builder import build_train_step, refuse_training_step_override
from ddpkit.training.token_loss import TokenCount
from ddpkit.training.train_step import AccumulationStep, StepReporting, TrainStep

__all__ = [
    "apply_lora",
    "Evaluation",
    "refuse_what_cannot_fit",
    "TrainingHealth",
    "watched",
    "evaluate",
    "optimizer_order",
    "OptimizerStep",
    "build_optimizer",
    "build_scheduler",
    "RngStreams",
    "steps",
    "EarlyStopping",
    "seed_for_setup",
    "TokenCount",
    "TrainingSamples",
    "AccumulationStep",
    "StepReporting",
    "TrainStep",
    "build_train_step",
    "refuse_training_step_override",
]
