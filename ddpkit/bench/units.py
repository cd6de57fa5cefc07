"""Parsing what people type on a benchmark command line: byte sizes, size ranges, process counts.

    parse_size("256MB")            -> 268435456      (K/M/G are powers of 1024, as in nccl-tests)
    parse_sizes("1KB..1MB")        -> [1024, 2048, ..., 1048576]   (doubling, like nccl-tests -f 2)
    parse_sizes("4KB,1MB,64MB")    -> [4096, 1048576, 67108864]
    parse_nproc("1,2,4")           -> [1, 2, 4]

Every parser raises :class:`BenchUsageError` (exit code 2) with the offending text and an
example of what is accepted.
"""

from __future__ import annotations

import re

from ddpkit.errors import DdpkitError

__all__ = ["BenchUsageError", "parse_size", "parse_sizes", "parse_nproc", "parse_floats", "format_bytes"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
#: Upper bound on how many sizes one range may expand to (a typo like 1B..1GB:1.001 would hang).
MAX_SIZES = 64


class BenchUsageError(DdpkitError):
    """A ``ddpkit bench`` option has a value that cannot work; the message says what would."""

    exit_code = 2


def parse_size(text: str, *, option: str = "--sizes") -> int:
    """Bytes in ``text``: ``512``, ``512B``, ``4KB``, ``4K``, ``4KiB``, ``1.5MB``, ``2GB``."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise BenchUsageError(
            f"{option}: cannot read {text!r} as a size; write e.g. 512B, 4KB, 16MB or 1GB (K/M/G = 1024-based)"
        )
    size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise BenchUsageError(f"{option}: {text!r} is not a positive size")
    return size


def parse_sizes(text: str, *, factor: int = 2, option: str = "--sizes") -> list[int]:
    """``MIN..MAX`` (multiplying by ``factor`` each time), a comma list, or one size; sorted, unique."""
    if factor < 2:
        raise BenchUsageError(f"--step-factor: {factor} must be at least 2")
    if ".." in text:
        low_text, _, high_text = text.partition("..")
        low = parse_size(low_text, option=option)
        high = parse_size(high_text, option=option)
        if low > high:
            raise BenchUsageError(f"{option}: {text!r} runs backwards; write the smaller size first, e.g. 1KB..256MB")
        sizes = [low]
        while sizes[-1] * factor <= high:
            sizes.append(sizes[-1] * factor)
        if sizes[-1] != high:
            sizes.append(high)
    else:
        sizes = sorted({parse_size(part, option=option) for part in text.split(",") if part.strip()})
        if not sizes:
            raise BenchUsageError(f"{option}: no size given; write e.g. 1KB..256MB or 4KB,1MB")
    if len(sizes) > MAX_SIZES:
        raise BenchUsageError(
            f"{option}: {text!r} expands to {len(sizes)} sizes (at most "
            f"{MAX_SIZES}); use a larger --step-factor or a narrower range"
        )
    return sizes


def parse_nproc(text: str, *, option: str = "--nproc-per-node", minimum: int = 1, maximum: int = 1024) -> list[int]:
    """Comma-separated process counts, each in ``[minimum, maximum]``; sorted, unique."""
    try:
        counts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise BenchUsageError(f"{option}: {text!r} is not a comma-separated list of process counts, e.g. 1,2") from None
    if not counts:
        raise BenchUsageError(f"{option}: no process count given; write e.g. {option} 1,2")
    bad = [n for n in counts if not minimum <= n <= maximum]
    if bad:
        raise BenchUsageError(
            f"{option}: {bad[0]} is out of range; each process count must be between {minimum} and {maximum}"
        )
    return counts


def parse_floats(text: str, *, option: str) -> list[float]:
    """Comma-separated positive numbers (e.g. bucket sizes in MiB); sorted, unique."""
    try:
        values = sorted({float(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise BenchUsageError(f"{option}: {text!r} is not a comma-separated list of numbers, e.g. 1,5,25") from None
    if not values or values[0] <= 0:
        raise BenchUsageError(f"{option}: {text!r} must list positive numbers, e.g. 1,5,25")
    return values


def format_bytes(size: int) -> str:
    """``1024 -> '1KB'``, ``1572864 -> '1.5MB'`` (1024-based, matching :func:`parse_size`)."""
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:g}{unit}"
    return f"{size}B"
