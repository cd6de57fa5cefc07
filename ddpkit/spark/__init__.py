"""ddpkit on Spark: a Trainer script as one barrier stage, started again after a failure, resuming from its checkpoints.

    import ddpkit.spark
    metrics = ddpkit.spark.run("train.py", "config.yaml", "run.output_dir=/shared/runs/a", num_processes=4,
                               max_restarts=3)

    ddpkit spark CONFIG [key=value ...] --num-processes 4 [--max-restarts 3] [--script train.py] [--master URL]

``pip install "ddpkit[spark]"`` (pyspark; Java 17 on every machine). The same script also runs
unchanged under Spark's own ``TorchDistributor(num_processes=N, local_mode=False, use_gpu=False).run(
"train.py", "config.yaml", ...)``, which starts torchrun in each barrier task; what ``ddpkit.spark.run``
adds (docs/engines.md): a driver-side retry that starts the barrier stage again and resumes from the
run's checkpoints, so a killed rank costs no completed step; every rank's lines on the driver; the
job's exit code, which TorchDistributor's file mode loses (it returns ``None`` when every rank failed);
each rank on the GPU Spark schedules to its task.

- ``driver``: :func:`run`, the attempts and what each rank's exit code means for the next one.
- ``task``: what each barrier task runs: torchrun's variables for its rank, the program as a child process.
- ``logs``: every rank's lines from the executors to the driver's stderr.
- ``command``: ``ddpkit spark``, the command line over :func:`run`.
"""

from ddpkit.spark.driver import SparkJobFailed, run

__all__ = ["run", "SparkJobFailed"]
