"""Tokens per second and model FLOPs utilisation (MFU), for the records of language-model runs.

    throughput = TokenThroughput(tokens_per_sample=1024, flops_per_token=model.flops_per_token(),
                                 peak_flops=peak_flops(device, "bf16"), world_size=8)
    throughput.fields(samples=512, seconds=2.0)    # {"tokens_per_s": 262144.0, "mfu": 0.41}

``tokens_per_s`` is global (every rank's tokens). Where they come from, in this order: the exact
count of the tokens the loss saw (``train.loss_normalization: tokens``, padding excluded, read at
log time from the count the step already all-reduces), else samples times the dataset's
``seq_len`` (a token file: every position is a token). A run whose dataset declares no ``seq_len``
and whose steps count no tokens logs neither field.

``mfu`` = tokens/s x training FLOPs per token / (peak FLOP/s of one device x world size), as in
the PaLM paper and nanoGPT. The FLOPs per token come from the model's ``flops_per_token()`` (the
built-in ``gpt`` has it; define it on your own model to get ``mfu``); the peak from
``train.peak_tflops``, else from :data:`PEAK_TFLOPS` by the GPU's name and the run's precision.
On a CPU with no ``train.peak_tflops`` there is no ``mfu``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ddpkit.config.schema import Config
from ddpkit.distributed.process_group import Runtime

__all__ = ["TokenThroughput", "TokenTotal", "peak_flops", "PEAK_TFLOPS"]


class TokenTotal(Protocol):
    """What counts the loss's tokens (``ddpkit.training.token_loss.TokenCount``): every rank's, since the last read."""

    def read_total(self) -> float: ...


#: Dense (no sparsity) peak TFLOP/s per GPU by name fragment: bf16 / fp16 tensor cores, and fp32
#: without TF32 (vendors' data sheets; SXM parts). The first fragment found in the device name wins.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 67.0},
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "RTX 4090": {"bf16": 165.0, "fp16": 165.0, "fp32": 82.6},
    "V100": {"bf16": 0.0, "fp16": 125.0, "fp32": 15.7},
}


def peak_flops(device: torch.device, precision: str, *, configured_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one ``device`` at ``precision``: ``configured_tflops`` if given, else the table; None if
    unknown."""
    if configured_tflops is not None:
        return configured_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment in name and peaks.get(precision):
            return peaks[precision] * 1e12
    return None


class TokenThroughput:
    """Turns a window of training (samples, seconds) into ``tokens_per_s`` and, when it can, ``mfu``."""

    def __init__(
        self,
        *,
        tokens_per_sample: int | None = None,
        counted: Callable[[], float] | None = None,
        flops_per_token: float | None = None,
        peak_flops: float | None = None,
        world_size: int = 1,
    ):
        self.tokens_per_sample = tokens_per_sample
        self.counted = counted
        self.flops_per_token = flops_per_token
        self.peak_flops = peak_flops
        self.world_size = world_size

    @classmethod
    def for_run(
        cls,
        config: Config,
        runtime: Runtime,
        *,
        model: torch.nn.Module,
        dataset: Any,
        counter: TokenTotal | None = None,
    ) -> TokenThroughput:
        """What ``config`` and the built ``model`` / ``dataset`` tell: tokens per sample (the dataset's
        ``seq_len``), FLOPs per token (the model's ``flops_per_token()``), the device's peak; ``counter``:
        the step's token count under ``loss_normalization: tokens`` (its ``read_total``), or None."""
        counted = counter.read_total if counter is not None else None
        tokens_per_sample = getattr(dataset, "seq_len", None)
        flops = getattr(model, "flops_per_token", None)
        return cls(
            tokens_per_sample=tokens_per_sample,
            counted=counted,
            world_size=runtime.env.world_size,
            flops_per_token=(flops(tokens_per_sample) if tokens_per_sample else flops()) if callable(flops) else None,
            peak_flops=peak_flops(runtime.device, config.train.precision, configured_tflops=config.train.peak_tflops),
        )

    @property
    def enabled(self) -> bool:
        """Whether records get ``tokens_per_s`` at all."""
        return self.counted is not None or self.tokens_per_sample is not None

    def fields(self, *, samples: float, seconds: float) -> dict[str, float]:
        """``tokens_per_s`` (and ``mfu``) of a window of ``samples`` trained in ``seconds``; {} when tokens are
        unknown."""
        if not self.enabled:
            return {}
        tokens = self.counted() if self.counted is not None else samples * self.tokens_per_sample
        per_s = tokens / max(seconds, 1e-9)
        fields = {"tokens_per_s": per_s}
        if self.flops_per_token and self.peak_flops:
            fields["mfu"] = per_s * self.flops_per_token / (self.peak_flops * self.world_size)
        return fields
