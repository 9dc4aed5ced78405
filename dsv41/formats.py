"""Byte facts of the storage formats (DESIGN §3.8, §5): element widths and block-scale layouts.

These are the facts the KV accounting is computed from. The quantisers that produce the values
live in `dsv41.quant`; this module only knows how many bytes each format takes.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

from dsv41.errors import ConfigError

# Element formats by name. "fp8" is the user schema's spelling of FP8 E4M3 (configs/v41_flash.json).
ELEMENT_BITS = {
    "fp4_e2m1": 4,
    "fp8_e4m3": 8,
    "fp8": 8,
    "bf16": 16,
    "fp32": 32,
}

# Block-scale element formats: E4M3 and UE8M0 (a power of two) take one byte, fp32 four.
SCALE_BYTES = {"e4m3": 1, "ue8m0": 1, "fp32": 4}

_SCALE_RE = re.compile(r"^(?P<dtype>[a-z0-9]+)_per_(?P<block>\d+)_channel$")


@dataclasses.dataclass(frozen=True)
class Scale:
    """One scale of `dtype` for every `block` consecutive channels."""

    dtype: str
    block: int


@dataclasses.dataclass(frozen=True)
class Part:
    """`count` vectors of `dims` channels stored as `dtype` with an optional block scale."""

    dims: int
    dtype: str
    scale: Scale | None = None
    count: int = 1

    @property
    def bytes(self) -> Fraction:
        values = Fraction(self.count * self.dims * ELEMENT_BITS[self.dtype], 8)
        if self.scale is None:
            return values
        return values + self.count * (self.dims // self.scale.block) * SCALE_BYTES[self.scale.dtype]


def check_dtype(field: str, name) -> str:
    """Returns `name` if it is a known element format, else raises ConfigError naming `field`."""
    if name not in ELEMENT_BITS:
        raise ConfigError(field, name, f"expected an element format, one of {sorted(ELEMENT_BITS)}")
    return name


def parse_scale(field: str, spec) -> Scale | None:
    """Parses a scale spec such as "e4m3_per_16_channel" or "ue8m0_per_32_channel"; "none" is None."""
    if spec == "none":
        return None
    m = _SCALE_RE.match(spec) if isinstance(spec, str) else None
    if m is None or m["dtype"] not in SCALE_BYTES or int(m["block"]) <= 0:
        raise ConfigError(
            field, spec,
            f"expected 'none' or '<scale>_per_<N>_channel' with <scale> one of {sorted(SCALE_BYTES)} and N > 0",
        )
    return Scale(m["dtype"], int(m["block"]))


def make_part(field: str, dims: int, dtype: str, scale_spec: str = "none", count: int = 1) -> Part:
    """Builds a Part, checking that `dims` fills whole scale blocks and whole bytes."""
    check_dtype(f"{field}.dtype", dtype)
    scale = parse_scale(f"{field}.scale", scale_spec)
    if scale is not None and dims % scale.block:
        raise ConfigError(
            f"{field}.dims", dims,
            f"expected a multiple of the {scale.dtype} scale block {scale.block} of '{scale_spec}'",
        )
    if (dims * ELEMENT_BITS[dtype]) % 8:
        raise ConfigError(f"{field}.dims", dims, f"expected whole bytes of {dtype} values")
    return Part(dims=dims, dtype=dtype, scale=scale, count=count)


def align_up(nbytes: Fraction, align_bytes: int) -> Fraction:
    """`nbytes` padded up to a multiple of `align_bytes`."""
    return Fraction(-((-nbytes) // align_bytes) * align_bytes)


def entry_bytes(parts: list[Part], align_bytes: int = 1) -> Fraction:
    """Bytes of one stored entry made of `parts`, padded up to a multiple of `align_bytes`."""
    return align_up(sum((p.bytes for p in parts), Fraction(0)), align_bytes)
