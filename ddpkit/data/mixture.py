"""Mixtures of token files: sources blended by weight, every global batch holding each source's share.

    data:
      name: tokens
      global_batch_size: 32                     # the same batches at any world size (ddpkit.data.elastic)
      kwargs:
        seq_len: 256
        sources:                                # instead of path: weights need not sum to 1
          - {name: web, path: data/web.bin, weight: 0.6}
          - {name: code, path: data/code.bin, weight: 0.3}
          - {name: math, path: data/math.bin, weight: 0.1}
        val_sources:                            # optional: val_loss/web, val_loss/code, ... and the overall val_loss
          - {name: web, path: data/web_val.bin}
          - {name: code, path: data/code_val.bin}
        repeat: true                            # false: refuse a source the run would read more than once

Order. Global batch ``k`` (the ``G`` windows of optimizer step ``k``) holds ``floor`` or ``ceil`` of
``G * weight / sum(weights)`` windows of each source (:class:`~ddpkit.data.mixture_schedule.BatchShares`:
a deterministic interleave, never a random draw). A source's windows are read in an index-free keyed
permutation (:class:`~ddpkit.data.order.FeistelOrder`) keyed by the run's seed and the pass over
that source, each pass a new permutation. Slot ``p`` of epoch ``e`` therefore maps to its window by
arithmetic alone: the sampler walks positions in order (the mixture does its own shuffling), a
resume continues at the saved position, and with ``data.global_batch_size`` the batches are the same
at any world size. An epoch is as many windows as the sources hold together, rounded down to whole
global batches; a source whose share of the run exceeds its size is read again (in a new order), and
the number of passes over every source is logged at the start (``repeat: false`` refuses instead).

The consumed windows of each source at step ``k`` are a closed form too: :func:`consumed_tokens` adds
``tokens/<name>`` to a metrics record without any counting or collective.
"""

from __future__ import annotations

import copy
import difflib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from ddpkit.data.mixture_schedule import BatchShares
from ddpkit.data.order import FeistelOrder
from ddpkit.errors import DataError

__all__ = [
    "Source",
    "TokenMixture",
    "MixtureValidation",
    "mixture_datasets",
    "is_mixture",
    "consumed_tokens",
    "report_passes",
]

log = logging.getLogger("ddpkit")
_SOURCE_KEYS = ("name", "path", "weight", "dtype")
_UNPLANNED = (
    "a TokenMixture is read through ddpkit's training loader (build_train_loader), which plans it for the "
    "global batch; or call .planned(global_batch_size=..., seed=...) yourself"
)
#: Opens one token file: ``(path, dtype) -> TokenFile`` (:mod:`ddpkit.data.tokens` passes it in).
OpenFile = Callable[[str, "str | None"], Any]


@dataclass(frozen=True)
class Source:
    """One source of a mixture: its name (the metrics' suffix), weight and opened token file."""

    name: str
    weight: float
    # A TokenFile: len(), [window] -> (x, y), n_tokens, seq_len, dtype, require_vocab.
    file: Any


def parse_sources(raw: Any, *, key: str, open_file: OpenFile, weighted: bool) -> list[Source]:
    """The list under ``key`` (``data.kwargs.sources`` or ``val_sources``), checked, each file opened."""
    if not isinstance(raw, (list, tuple)) or not raw:
        raise DataError(f"{key}: expected a non-empty list of {{name, path, weight}}, got {raw!r}")
    sources = [_source(entry, key=f"{key}[{i}]", open_file=open_file, weighted=weighted) for i, entry in enumerate(raw)]
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise DataError(f"{key}: the name {twice[0]!r} is used twice; give every source its own name")
    dtypes = {s.file.dtype.name for s in sources}
    if len(dtypes) > 1:
        found = ", ".join(f"{s.name} {s.file.dtype.name}" for s in sources)
        raise DataError(
            f"{key}: the files hold different token dtypes ({found}); tokenize every source with the same "
            "tokenizer and dtype, or set each source's dtype to what its file holds"
        )
    if weighted and not sum(s.weight for s in sources) > 0:
        raise DataError(
            f"{key}: the weights sum to {sum(s.weight for s in sources)}; give at least one source a positive weight"
        )
    return sources


def _source(entry: Any, *, key: str, open_file: OpenFile, weighted: bool) -> Source:
    if not isinstance(entry, dict):
        raise DataError(f"{key}: expected a mapping {{name, path, weight}}, got {entry!r}")
    for unknown in set(entry) - set(_SOURCE_KEYS):
        close = difflib.get_close_matches(unknown, _SOURCE_KEYS, n=1)
        raise DataError(
            f"{key}.{unknown}: unknown key{f'; did you mean {close[0]!r}?' if close else ''} "
            f"(a source has {', '.join(_SOURCE_KEYS)})"
        )
    name = entry.get("name")
    path = entry.get("path")
    if not isinstance(name, str) or not name or "/" in name:
        raise DataError(f"{key}.name: expected a name without '/' (it becomes val_loss/<name>), got {name!r}")
    if not isinstance(path, str) or not path:
        raise DataError(f"{key}.path: expected the path of a token file, got {path!r}")
    weight = entry.get("weight", 1.0 if not weighted else None)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight < 0 or weight != weight:
        raise DataError(f"{key}.weight: expected a number >= 0 (the source's share of every batch), got {weight!r}")
    try:
        file = open_file(path, entry.get("dtype"))
    except DataError as exc:
        raise DataError(f"{key} ({name}): {exc}") from None
    return Source(name, float(weight), file)


class TokenMixture(Dataset):
    """Training windows of several token files blended by weight; see the module docstring.

    Built unplanned by the ``tokens`` builder; the training loader calls :meth:`planned` with the
    global batch size and seed, and reads windows by ``(epoch, position)`` keys.
    """

    def __init__(self, sources: Sequence[Source], *, repeat: bool = True):
        self.sources = list(sources)
        self.repeat = repeat
        self.names = [s.name for s in self.sources]
        self.seq_len: int = self.sources[0].file.seq_len
        # data.kwargs.document_mask, shared by every source.
        self.documents = self.sources[0].file.documents
        self.schedule: BatchShares | None = None
        self.seed = 0
        # The last batch's layout.
        self._cache: tuple[int, np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def windows(self) -> np.ndarray:
        """Windows in each source file."""
        return np.array([len(s.file) for s in self.sources], dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per epoch: as many windows as the sources hold together, in whole batches."""
        if self.schedule is None:
            raise DataError(_UNPLANNED)
        return int(self.windows.sum()) // self.schedule.global_batch_size

    def planned(self, *, global_batch_size: int, seed: int) -> TokenMixture:
        """This mixture, read in global batches of ``global_batch_size`` windows in the order of ``seed``."""
        plan = copy.copy(self)
        plan.schedule = BatchShares([s.weight for s in self.sources], global_batch_size=global_batch_size, seed=seed)
        plan.seed = seed
        plan._cache = None
        return plan

    def require_vocab(self, vocab_size: int) -> None:
        """Check every window read against the vocabulary (see ``TokenFile.require_vocab``)."""
        for source in self.sources:
            source.file.require_vocab(vocab_size)

    def __len__(self) -> int:
        if self.schedule is None:
            return int(self.windows.sum())
        return self.steps_per_epoch * self.schedule.global_batch_size

    def windows_before(self, batch: int) -> np.ndarray:
        """Windows read from each source by global batches ``0 .. batch-1`` (every epoch counted)."""
        if self.schedule is None:
            raise DataError(_UNPLANNED)
        return self.schedule.before(batch)

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, position = key if isinstance(key, tuple) else (0, key)
        g = self.schedule.global_batch_size if self.schedule is not None else 1
        batch = epoch * self.steps_per_epoch + position // g
        slot = position % g
        first, sources, within = self._layout(batch)
        source = int(sources[slot])
        # How many windows of this source came before this one.
        read = int(first[source] + within[slot])
        n = len(self.sources[source].file)
        passes, offset = divmod(read, n)
        # A new order each pass.
        order = FeistelOrder(n, seed=self.seed, epoch=passes * len(self.sources) + source)
        return self.sources[source].file[int(order.at(np.array([offset]))[0])]

    def _layout(self, batch: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # The slots of one batch are read together: compute once.
        if self._cache is None or self._cache[0] != batch:
            assert self.schedule is not None, "read through ddpkit's training loader, which plans the mixture"
            self._cache = (batch, self.schedule.before(batch), *self.schedule.layout(batch))
        return self._cache[1], self._cache[2], self._cache[3]

    def __repr__(self) -> str:
        parts = ", ".join(f"{s.name}={s.weight:g}" for s in self.sources)
        return f"TokenMixture({parts}, seq_len={self.seq_len})"


class MixtureValidation(Dataset):
    """Every window of each validation source once, as ``(x, y, source name)``.

    The built-in ``validation_step`` reports the names' losses as ``val_loss/<name>`` next to the
    token-weighted ``val_loss`` over all of them.
    """

    def __init__(self, sources: Sequence[Source]):
        self.sources = list(sources)
        self.seq_len: int = self.sources[0].file.seq_len
        self.documents = self.sources[0].file.documents
        self._starts = np.cumsum([0] + [len(s.file) for s in self.sources])

    def require_vocab(self, vocab_size: int) -> None:
        for source in self.sources:
            source.file.require_vocab(vocab_size)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, str]:
        source = int(np.searchsorted(self._starts, index, side="right")) - 1
        x, y = self.sources[source].file[index - int(self._starts[source])]
        return x, y, self.sources[source].name


def mixture_datasets(
    sources: Any, val_sources: Any, *, open_file: OpenFile, repeat: bool = True
) -> tuple[TokenMixture, MixtureValidation | None]:
    """``(train, val)`` of the ``tokens`` builder's ``sources`` / ``val_sources`` (val None without them)."""
    if not isinstance(repeat, bool):
        raise DataError(f"data.kwargs.repeat: expected true or false, got {repeat!r}")
    train = TokenMixture(
        parse_sources(sources, key="data.kwargs.sources", open_file=open_file, weighted=True), repeat=repeat
    )
    if val_sources is None:
        return train, None
    return train, MixtureValidation(
        parse_sources(val_sources, key="data.kwargs.val_sources", open_file=open_file, weighted=False)
    )


def is_mixture(dataset: Any) -> bool:
    """Whether ``dataset`` is a :class:`TokenMixture` (it orders its own windows: the sampler must not shuffle)."""
    return isinstance(dataset, TokenMixture)


def report_passes(dataset: Any, *, total_steps: int) -> None:
    """Log how many passes a run of ``total_steps`` makes over each source; with ``repeat: false``, refuse a second.

    Does nothing for a dataset that is not a planned mixture.
    """
    if not is_mixture(dataset) or dataset.schedule is None:
        return
    read = dataset.windows_before(total_steps)
    held = dataset.windows
    passes = read / np.maximum(held, 1)
    over = [i for i, p in enumerate(passes) if p > 1]
    if over and not dataset.repeat:
        i = over[0]
        raise DataError(
            f"data.kwargs.sources[{i}] ({dataset.names[i]}): the run reads {int(read[i]):,} windows of its "
            f"{int(held[i]):,} ({passes[i]:.2f} passes) and data.kwargs.repeat is false; lower its weight, "
            "train fewer steps, add data, or set data.kwargs.repeat=true"
        )
    log.info(
        "mixture over %d steps: %s",
        total_steps,
        ", ".join(
            f"{name} {int(r):,} windows of {int(h):,} ({p:.2f} passes{', repeated' if p > 1 else ''})"
            for name, r, h, p in zip(dataset.names, read, held, passes)
        ),
    )


def consumed_tokens(loader: Any, step: int) -> dict[str, int]:
    """``{"tokens/<name>": tokens}`` each source gave the first ``step`` optimizer steps ({} unless a mixture).

    A closed form of the schedule, the same on every rank: no counter, no collective. Meant for the
    training record: ``extra={**health.log_fields(), **consumed_tokens(train_loader, progress.step)}``.
    """
    dataset = getattr(loader, "dataset", None)
    if not is_mixture(dataset) or dataset.schedule is None:
        return {}
    counts = dataset.windows_before(step) * dataset.seq_len
    return {f"tokens/{name}": int(count) for name, count in zip(dataset.names, counts)}
