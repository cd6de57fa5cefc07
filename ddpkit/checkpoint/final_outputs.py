"""The run's final weights: ``model.pt`` (one file, the whole model), and ``hf/`` for a split model.

    save_final_model(held, output_dir, rank=rank, config=cfg, layout=layout)   # every rank calls it, at the end

The rule, ``checkpoint.model_pt`` (:func:`final_outputs`):

- ``hf/`` is written when the layout splits the model (a pipeline, a tensor plan, FSDP2) and the model is ddpkit's
  ``gpt`` without a LoRA adapter: every rank writes what it holds (ddpkit.checkpoint.hf_output); no rank and no host
  ever holds the whole model for it.
- ``model.pt`` is written under ``true``, never under ``false``, and under ``auto`` (the default) when each rank
  holds the whole model anyway (a world of one, ddp, zero1), when there is no ``hf/`` to write instead, or when the
  whole model fits :data:`HOST_SHARE` of the memory available on rank 0's host. Rank 0 then holds the whole model's
  bytes once (ddpkit.checkpoint.model_export), beside its own part and its host's other ranks' parts: the share
  leaves them the rest.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.checkpoint.hf_output import save_hf_directory
from ddpkit.checkpoint.model_export import save_model
from ddpkit.config.schema import Config
from ddpkit.reporting.log import log

__all__ = ["save_final_model", "final_outputs", "HF_DIRECTORY", "HOST_SHARE"]

#: The Hugging Face directory's name in the run's output directory.
HF_DIRECTORY = "hf"
#: ``model_pt: auto`` under a split layout: model.pt when the whole model takes at most this share of the memory
#: available on rank 0's host when the run ends.
HOST_SHARE = 0.25


def final_outputs(model_pt: bool | str, *, splits_model: bool, hf_form: bool, fits_host: bool) -> tuple[bool, bool]:
    """``(model.pt, hf/)``: which of the two a run writes at its end.

    ``model_pt``: ``checkpoint.model_pt`` (true, false or ``auto``); ``splits_model``: no rank holds the whole model
    (a pipeline, a tensor plan, FSDP2); ``hf_form``: the model has a Hugging Face form (``gpt``, no LoRA);
    ``fits_host``: the whole model fits :data:`HOST_SHARE` of rank 0's host's available memory."""
    hf = splits_model and hf_form
    if model_pt == "auto":
        return not hf or fits_host, hf
    return bool(model_pt), hf


def save_final_model(model: torch.nn.Module, output_dir: Path, *, rank: int, config: Config, layout: Any) -> None:
    """The run's final weights by :func:`final_outputs`'s rule (every rank calls it: the writes are collectives).

    ``model``: the rank's bare held model; ``layout``: the run's ``ParallelLayout``."""
    hf_form = config.model.name == "gpt" and config.model.lora is None
    model_pt = config.checkpoint.model_pt
    # Only asked where it decides something: it is a collective
    fits = layout.splits_model and hf_form and model_pt == "auto" and _fits_rank0_host(model, rank=rank)
    pt, hf = final_outputs(model_pt, splits_model=layout.splits_model, hf_form=hf_form, fits_host=fits)
    if hf:
        why_not = save_hf_directory(model, output_dir / HF_DIRECTORY, model_kwargs=config.model.kwargs, rank=rank)
        if why_not is not None:
            # No Hugging Face form after all, or no disk every rank sees: auto's rule writes model.pt in its place
            pt = pt or model_pt == "auto"
            if rank == 0:
                log.warning("%s not written: %s%s", HF_DIRECTORY, why_not, "; writing model.pt instead" if pt else "")
    if pt:
        save_model(model, output_dir / "model.pt", rank=rank, pipeline=layout if layout.pp > 1 else None)


def _fits_rank0_host(model: torch.nn.Module, *, rank: int) -> bool:
    """Whether the whole model's bytes fit :data:`HOST_SHARE` of rank 0's available memory (every rank's answer is
    rank 0's). A DTensor's ``numel`` is the whole tensor's; a name held by several ranks counts once."""
    held = {name: value.numel() * value.element_size() for name, value in model.state_dict().items()}
    every: list[dict[str, int]] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, held)
    size = sum({name: count for part in every for name, count in part.items()}.values())
    verdict = [size <= HOST_SHARE * _available_bytes() if rank == 0 else False]
    dist.broadcast_object_list(verdict, src=0)
    if rank == 0 and not verdict[0]:
        log.info("model.pt not written: the model's %.1f GB exceed a quarter of this host's free memory", size / 1e9)
    return bool(verdict[0])


def _available_bytes() -> int:
    """Memory the host can give without swapping: ``MemAvailable`` (page cache counts), else the free pages."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
