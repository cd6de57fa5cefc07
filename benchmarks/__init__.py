"""ddpkit's benchmarks: side-by-side measurements, run from the repository root as modules.

    python -m benchmarks.overhead            # per-step cost of the Trainer vs a hand-written DDP loop (and peers)
    python -m benchmarks.lm                  # a GPT on 2 Gloo ranks: ddpkit vs a hand-written nanoGPT-style loop
    python -m benchmarks.compare_peers       # ddpkit vs the hand-written loop, Fabric, Accelerate, Lightning
    python -m benchmarks.trees hand=.:hand-written after=.:ddpkit before=/tmp/before:ddpkit   # two checkouts
    python -m benchmarks.compile             # torch.compile: hand-written eager / compiled vs ddpkit's
    python -m benchmarks.gpu                 # one CUDA GPU: resnet50 through a DataLoader, hand-written vs ddpkit
    python -m benchmarks.gpu_bound           # one GPU, data on it: GPT-2 124M / resnet50 / Llama 1B, hand vs ddpkit
    python -m benchmarks.gpu_generate        # one GPU, bf16: Llama 1B generation, KV cache vs none, batch 1 and 8
    python -m benchmarks.generate            # GPT-2 124M sampling with vs without the KV cache; decay groups' cost
    python -m benchmarks.gloo_collectives    # FSDP2's all-gather and reduce-scatter on Gloo: Gloo's own vs in place
    python -m benchmarks.startup             # import time and time to the first step
    python -m benchmarks.time_to_accuracy    # launch to exit, to 95% on the digits data (hand side: tta_hand)
    python -m benchmarks.feature_cost --feature health|watchdog|goodput|step-parts   # what each per-step feature costs
    python -m benchmarks.checkpoint          # the loop's stall per save: synchronous vs checkpoint.async
    python -m benchmarks.goodput --rounds 2 --faults 5   # goodput under injected faults, recovery time split
    python -m benchmarks.restart             # restart to the first step after a SIGKILL: new interpreter vs warm
    python -m benchmarks.modes               # parallel.mode ddp / zero1 / fsdp2: step time and bytes per rank
    python -m benchmarks.order               # epoch orders: memory and time to the first batch, batches/s
    python -m benchmarks.shared_memory       # PSS of an in-memory dataset: a Python list vs SharedDataset
    python -m benchmarks.streaming           # a sharded stream vs map-style, and the agreed stop's cost
    python -m benchmarks.control_plane --ranks 1000,10000,100000   # the hang watchdog's store traffic and CPU at scale
    python -m benchmarks.background_threads  # CPU of ddpkit's background threads per second of training, by thread
    python -m benchmarks.remote_checkpoint   # step time with checkpoints mirrored to a local S3 (moto) vs local only
    python -m benchmarks.inprocess_recovery  # a Gloo survivor rebuilds its group with a replacement: the timings
    python -m benchmarks.activation_checkpointing   # gpt2 at context 1,024: peak memory and step time, on vs off
    python -m benchmarks.document_mask       # packed documents: masked attention's step time vs plain causal
    python -m benchmarks.lora                # LoRA vs a full fine-tune at SmolLM2-135M's shape: params, bytes, time
    python -m benchmarks.pipeline            # pp2 on 2 Gloo ranks: bubble vs theory, throughput, activations held
    python -m benchmarks.tensor_parallel     # tp2 on 2 Gloo ranks against a world of one and ddp: step time, bytes
    python -m benchmarks.memory              # each rank's peak host memory in every layout, a 1 GB Llama shape
    python -m benchmarks.spark_startup       # start-up of ddpkit.spark.run and TorchDistributor against torchrun

``benchmarks.workloads`` is not a benchmark: it holds what they share (the workloads, the shared
hand-written DDP loop ``train_by_hand`` and the benchmarks that keep a loop of their own, the weight
digest, the accuracy helper, medians, paired ratios, tables and the load average).
``benchmarks.tta_hand`` is launched by ``benchmarks.time_to_accuracy`` under torchrun. Workers that a
benchmark starts in new processes import ``benchmarks`` through ``PYTHONPATH``
(``benchmarks.workloads.child_env``), never by editing the import path in code. Measured numbers,
with dates and machines: ``benchmarks/RESULTS.md``. The user command ``ddpkit bench`` lives in ``ddpkit/bench/``.

Each runs the things it compares side by side in one process tree, alternating them over rounds,
and prints medians, ranges and paired ratios with the load average before and after: absolute times
on a shared machine are noise, ratios hold.
"""
