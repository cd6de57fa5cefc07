"""Train whatever a YAML config describes, on as many processes as torchrun starts.

    torchrun --nproc-per-node=2 examples/train.py configs/quickstart.yaml
    torchrun --nproc-per-node=2 examples/train.py configs/quickstart.yaml optim.lr=0.1 train.epochs=3
    python examples/train.py configs/quickstart.yaml            # a world of one, same code path

This is all a YAML-driven script needs; `ddpkit run CONFIG --nproc-per-node 2` does the same
without a script of your own.
"""

import ddpkit

if __name__ == "__main__":
    ddpkit.Trainer.main()
