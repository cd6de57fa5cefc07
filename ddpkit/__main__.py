"""``python -m ddpkit ...`` is the same command line as ``ddpkit ...``."""

from ddpkit.cli import main

if __name__ == "__main__":
    main()
