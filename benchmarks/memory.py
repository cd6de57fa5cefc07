"""What each rank holds in each layout: its peak host memory while the model is built and placed, and while training.

    python -m benchmarks.memory                          # a Llama shape of about 1 GB of fp32 weights, every layout
    python -m benchmarks.memory --dim 2048 --depth 3     # the same bytes in 3 wide blocks (the earlier default)
    python -m benchmarks.memory --dim 1024 --depth 4 --vocab 32000   # a smaller one (about 450 MB)
    python -m benchmarks.memory --init-from               # the same shape from a Hugging Face directory
    python -m benchmarks.memory --adamw fused --layouts one fsdp2   # AdamW's fused kernel (or loop) for foreach
    python -m benchmarks.memory --host-memory keep       # train.keep_host_memory: true in every layout
    python -m benchmarks.memory --lora 8                 # a LoRA fine-tune (r 8, every linear layer) of the same shape
    python -m benchmarks.memory --activation-checkpointing   # each block recomputes its activations in the backward
    python -m benchmarks.memory --layouts fsdp2 fsdp2-vocab  # fsdp2 with the vocabulary split outside its units

Each layout runs in fresh Gloo ranks on this host (``ddpkit.testing.run_on_ranks``). Every rank reads its own
``/proc/self/status``: its resident memory just before the model is built (the baseline: torch, ddpkit, the process
group, the data, and torch's FSDP2, pipelining and tensor-parallel modules, whichever the layout uses); its peak
from there to the first step (``VmHWM``, reset at the baseline through ``/proc/self/clear_refs``); its peak over
``--steps`` training steps (AdamW: gradients and two state tensors a parameter; 3 by default, because AdamW makes its
state in the first step, after that step's backward: only from the second step on does a backward run beside it,
and a one-step run reads a peak a steady run exceeds); and its peak to the end (the last
checkpoint and the final weights: ``model.pt``, which rank 0 writes whole, and a split layout's ``hf/``, which every
rank writes its part of; ``--model-pt false``: ``hf/`` alone). The table gives each number above the baseline,
the largest rank's, and the seconds from the baseline to the first step.

``--init-from``: the model's weights come from a Hugging Face directory (``model.kwargs.init_from``) that
transformers writes first (``LlamaForCausalLM.save_pretrained``, fp32, in shards of ``--shard-mb``; ``--bf16``: in
bf16), so the setup peak includes each rank's reads of its own tensors and slices (ddpkit.models.hf_slices).

Each layout's run directory (its ``model.pt`` and ``hf/``: a GB each at the default shape) is removed once it is
measured (``--keep-outputs`` keeps them), so a full table does not fill the disk.

``--lora R``: ``model.lora`` with rank ``R`` on every linear layer; the frozen base has no gradients or optimizer
state, so the goal printed is the base's share alone, x 1.1.

The goal (issue 67): while training, every sharded layout's peak per rank is at most (parameters + gradients +
optimizer state) / N x 1.1 above the baseline, where a world of one holds all of it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch

import ddpkit

#: The layouts measured: (label, ranks, parallel section).
LAYOUTS = [
    ("one", 1, {}),
    ("ddp", 2, {}),
    ("zero1", 2, {"mode": "zero1"}),
    ("fsdp2", 2, {"mode": "fsdp2"}),
    # the embedding and the head split by vocabulary rows outside FSDP2's units (parallel.fsdp.shard_vocabulary)
    ("fsdp2-vocab", 2, {"mode": "fsdp2", "fsdp": {"shard_vocabulary": True}}),
    ("pp2", 2, {"pipeline": 2}),
    ("tp2", 2, {"tensor": 2}),
    ("pp2xtp2", 4, {"pipeline": 2, "tensor": 2}),
]

MiB = 2**20


def status_bytes(field: str) -> int:
    """A ``/proc/self/status`` size (``VmRSS``, ``VmHWM``) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    """Start ``VmHWM`` again from the current resident memory (Linux: ``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


class Tokens(torch.utils.data.Dataset):
    """Random token windows (the data's bytes are nothing next to the model's)."""

    def __init__(self, vocab: int, length: int, n: int = 64):
        self.data = torch.randint(0, vocab, (n, length + 1), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.data[i, :-1], self.data[i, 1:]


class MemoryTrainer(ddpkit.Trainer):
    """Reads its memory at the baseline (before the model), at the first step and after training."""

    def build_datasets(self):
        kwargs = self.config.model.kwargs
        data = Tokens(kwargs["vocab_size"], kwargs["max_len"])
        # torch's modules that some layouts import on first use (tens of MiB of code): in every baseline alike
        import torch.distributed.fsdp
        import torch.distributed.pipelining
        import torch.distributed.tensor.parallel  # noqa: F401

        self.baseline = status_bytes("VmRSS")
        reset_peak()
        self.began = time.perf_counter()
        return data, None

    def on_fit_start(self) -> None:
        self.to_first_step = time.perf_counter() - self.began
        self.setup_peak = status_bytes("VmHWM")
        self.first_step_rss = status_bytes("VmRSS")

    def on_step_end(self, step: int) -> None:
        # the peak while training: before the end's checkpoint and model.pt
        self.train_peak = status_bytes("VmHWM")

    def on_fit_end(self, metrics: dict[str, float]) -> None:
        self.end_peak = status_bytes("VmHWM")
        self.end_rss = status_bytes("VmRSS")


#: AdamW's implementations (``--adamw``): torch's default (on CUDA ``foreach`` on lists of tensors, whose intermediate
#: results are lists as large as the parameters; on the CPU the loop), a loop over the parameters, or the fused kernel.
ADAMW = {"foreach": {}, "loop": {"foreach": False}, "fused": {"fused": True}}

#: ``--host-memory``: ``train.keep_host_memory``'s three values.
HOST_MEMORY = {"default": None, "keep": True, "give-back": False}


def config(
    out: str,
    model: dict[str, Any],
    parallel: dict[str, Any],
    steps: int,
    *,
    adamw: str = "foreach",
    keep: bool | None = None,
    model_pt: bool | str = "auto",
    lora: int = 0,
    recompute: bool = False,
) -> dict[str, Any]:
    """A run of ``steps`` AdamW steps (the ``adamw`` implementation) on a global batch of 4 (2 micro-batches), no
    checkpoint; ``keep``: ``train.keep_host_memory`` (true: freed blocks up to 32 MiB stay in the process; false:
    given back; None: the default, which keeps unless the layout splits the model); the final weights by
    ``checkpoint.model_pt``: ``model.pt`` and, for a split layout, ``hf/``; ``lora``: the adapter's rank (0: none);
    ``recompute``: ``train.activation_checkpointing``."""
    adapter = {"lora": {"r": lora, "alpha": 2 * lora, "targets": "all-linear"}} if lora else {}
    pipelined = parallel.get("pipeline", 1) > 1
    return {
        "run": {"name": "memory", "output_dir": out, "seed": 0},
        "data": {"global_batch_size": 4, "order": "index_free"},
        "model": {"name": "gpt", "kwargs": model, **adapter},
        "optim": {"name": "adamw", "lr": 1e-4, "kwargs": ADAMW[adamw]},
        "train": {
            "max_steps": steps,
            "grad_accum_steps": 1 if pipelined else 2,
            "loss_normalization": "tokens",
            "keep_host_memory": keep,
            "activation_checkpointing": recompute,
        },
        "parallel": {**parallel, **({"microbatches": 2} if pipelined else {})},
        "checkpoint": {"every_epochs": None, "every_steps": None, "model_pt": model_pt},
        "log": {"progress_bar": False},
    }


def measure_rank(cfg: dict[str, Any]) -> dict[str, float]:
    """One rank of one layout (run by ``run_on_ranks``): its numbers in MiB above its baseline, and seconds."""
    trainer = MemoryTrainer(cfg)
    trainer.fit()
    above = trainer.baseline
    return {
        "baseline": above / MiB,
        "setup_peak": (trainer.setup_peak - above) / MiB,
        "first_step": (trainer.first_step_rss - above) / MiB,
        "train_peak": (trainer.train_peak - above) / MiB,
        "end_peak": (trainer.end_peak - above) / MiB,
        "end": (trainer.end_rss - above) / MiB,
        "to_first_step": trainer.to_first_step,
    }


def measure(
    label: str,
    ranks: int,
    parallel: dict[str, Any],
    model: dict[str, Any],
    steps: int,
    out: str,
    adamw: str = "foreach",
    keep: bool | None = None,
    model_pt: Any = "auto",
    lora: int = 0,
    keep_outputs: bool = True,
    recompute: bool = False,
) -> list:
    """Every rank's numbers for one layout, in fresh processes; ``keep_outputs``: leave its run directory."""
    from ddpkit.testing import run_on_ranks

    directory = os.path.join(out, label)
    cfg = config(
        directory, model, parallel, steps, adamw=adamw, keep=keep, model_pt=model_pt, lora=lora, recompute=recompute
    )
    try:
        return run_on_ranks(measure_rank, ranks, args=(cfg,), timeout=1800)
    finally:
        if not keep_outputs:
            shutil.rmtree(directory, ignore_errors=True)


def model_bytes(model: dict[str, Any]) -> int:
    """The model's fp32 parameter bytes, from a meta build."""
    from ddpkit.models.gpt import build_gpt

    with torch.device("meta"):
        built = build_gpt(model, weights=False)
    return sum(p.numel() for p in built.parameters()) * 4


def goal_mib(label: str, ranks: int, weights: float, *, lora: bool = False) -> float:
    """The issue's goal for one layout: what a rank must hold (parameters, gradients, AdamW's two state tensors) of
    ``weights`` MiB of parameters, x 1.1; replicated layouts hold all of it, zero1 shards only the state. Under
    ``lora`` only the frozen base's share (the adapter's bytes are nothing next to it)."""
    if lora:
        return weights * 1.1 if label in ("one", "ddp", "zero1") else weights / ranks * 1.1
    if label in ("one", "ddp"):
        return 4 * weights * 1.1
    if label == "zero1":
        return (2 + 2 / ranks) * weights * 1.1
    return 4 * weights / ranks * 1.1


def write_hf_directory(model: dict[str, Any], directory: Path, *, shard_mb: int, bf16: bool) -> Path:
    """A random ``LlamaForCausalLM`` of ``model``'s shape, saved by transformers into ``directory`` (once)."""
    if (directory / "config.json").is_file():
        return directory
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=model["vocab_size"],
        hidden_size=model["dim"],
        intermediate_size=model["mlp_dim"],
        num_hidden_layers=model["depth"],
        num_attention_heads=model["heads"],
        num_key_value_heads=model["kv_heads"],
        max_position_embeddings=model["max_len"],
        tie_word_embeddings=model["tied"],
    )
    hf = transformers.LlamaForCausalLM(config)
    hf = hf.to(torch.bfloat16) if bf16 else hf
    hf.save_pretrained(directory, max_shard_size=f"{shard_mb}MB")
    return directory


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--layouts", nargs="*", default=[label for label, _, _ in LAYOUTS])
    parser.add_argument("--out", default="/tmp/ddpkit-memory")
    parser.add_argument("--init-from", action="store_true", help="read the weights from a Hugging Face directory")
    parser.add_argument("--shard-mb", type=int, default=200, help="--init-from: the directory's shard size")
    parser.add_argument("--bf16", action="store_true", help="--init-from: the directory's weights in bf16")
    parser.add_argument(
        "--model-pt", choices=["auto", "true", "false"], default="auto", help="checkpoint.model_pt: the end's files"
    )
    parser.add_argument("--adamw", choices=sorted(ADAMW), default="foreach", help="AdamW's implementation")
    parser.add_argument("--lora", type=int, default=0, help="model.lora's rank on every linear layer (0: none)")
    parser.add_argument("--keep-outputs", action="store_true", help="leave each layout's run directory")
    parser.add_argument(
        "--activation-checkpointing", action="store_true", help="train.activation_checkpointing: true (every block)"
    )
    parser.add_argument(
        "--host-memory",
        choices=sorted(HOST_MEMORY),
        default="default",
        help="train.keep_host_memory: keep (true), give-back (false), or the default (null: by layout)",
    )
    args = parser.parse_args(argv)
    model = {
        "arch": "llama",
        "vocab_size": args.vocab,
        "dim": args.dim,
        "depth": args.depth,
        "heads": 16,
        "kv_heads": 8,
        "mlp_dim": int(args.dim * 8 / 3) // 64 * 64,
        "max_len": 64,
        "tied": False,
    }
    weights = model_bytes(model) / MiB
    if args.init_from:
        name = f"hf-{args.dim}x{args.depth}-{args.vocab}-{'bf16' if args.bf16 else 'fp32'}-{args.shard_mb}"
        directory = write_hf_directory(model, Path(args.out) / name, shard_mb=args.shard_mb, bf16=args.bf16)
        files = sorted(directory.glob("*.safetensors"))
        print(f"init_from: {directory} ({len(files)} files, {sum(f.stat().st_size for f in files) / MiB:,.0f} MiB)")
        model = {"init_from": str(directory), "vocab_size": model["vocab_size"], "max_len": model["max_len"]}
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    trained = f"LoRA r={args.lora}, the base frozen" if args.lora else "x4 with gradients and two state tensors"
    recomputed = "; activations recomputed block by block" if args.activation_checkpointing else ""
    print(f"model: {weights:,.0f} MiB of fp32 parameters; AdamW ({args.adamw}): {trained}{recomputed}")
    print(
        f"{'layout':<9} {'ranks':>5} {'baseline':>9} {'setup peak':>11} {'first step':>11} {'train peak':>11} "
        f"{'goal':>9} {'end peak':>9} {'to step 1':>10}"
    )
    for label, ranks, parallel in LAYOUTS:
        if label not in args.layouts:
            continue
        model_pt = {"true": True, "false": False}.get(args.model_pt, args.model_pt)
        keep = HOST_MEMORY[args.host_memory]
        rows = measure(
            label,
            ranks,
            parallel,
            model,
            args.steps,
            args.out,
            args.adamw,
            keep,
            model_pt,
            lora=args.lora,
            keep_outputs=args.keep_outputs,
            recompute=args.activation_checkpointing,
        )
        worst = {key: max(row[key] for row in rows) for key in rows[0]}
        goal = goal_mib(label, ranks, weights, lora=bool(args.lora))
        print(
            f"{label:<9} {ranks:>5} {worst['baseline']:>8.0f}M {worst['setup_peak']:>10.0f}M "
            f"{worst['first_step']:>10.0f}M {worst['train_peak']:>10.0f}M {goal:>8.0f}M {worst['end_peak']:>8.0f}M "
            f"{worst['to_first_step']:>9.1f}s"
        )
        if ranks > 1:
            peaks = ", ".join(f"{row['train_peak']:.0f}M" for row in rows)
            print(f"{'':<9} train peak by rank: {peaks}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
