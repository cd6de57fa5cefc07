"""What one training step is made of, apart from the loop itself.

- ``optim``: optimizers and learning-rate schedules, registered by name.
- ``precision``: autocast and the fp16 gradient scaler; ``compile``: ``torch.compile`` from config.
- ``models``: the built-in models; ``metrics``: metrics reduced across ranks only when read.
- ``rng``: seeding, and capturing / restoring every generator; ``allocator``: host memory kept.
"""
