"""Compiles paid once (DESIGN §6): JAX's persistent compilation cache, in a directory on disk.

A second run of the same shapes loads its programs from the cache instead of compiling them. The
`dsv41` commands that run JAX programs turn it on (`--compile-cache DIR`, `--no-compile-cache`); a
library user calls `enable()` before the first compile. The directory, unless one is given:
`$DSV41_COMPILE_CACHE` (`off` turns the cache off), else `$XDG_CACHE_HOME/dsv41/jax`, else
`~/.cache/dsv41/jax`. JAX trusts what the cache holds: keep it in a directory only you can write.
"""

from __future__ import annotations

import os
from pathlib import Path

from dsv41.errors import ConfigError

ENV = "DSV41_COMPILE_CACHE"
OFF = "off"


def default_directory() -> Path | None:
    """The cache directory when none is given; None when `$DSV41_COMPILE_CACHE` is `off`."""
    value = os.environ.get(ENV, "")
    if value.lower() == OFF:
        return None
    if value:
        return Path(value).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dsv41" / "jax"


def enable(directory: str | os.PathLike | None = None, *, option: str = "directory") -> Path | None:
    """Turns on JAX's persistent compilation cache in `directory` (created if missing) and returns it.

    directory None: `default_directory()`; when that is None (`$DSV41_COMPILE_CACHE=off`) the cache
    stays off and None comes back. Programs compiled from then on are looked up and stored there.
    `option` names the setting the directory came from in an error (e.g. `--compile-cache`).
    """
    import jax
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    if directory is None:
        directory, option = default_directory(), ENV
        if directory is None:
            return None
    path = Path(directory).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ConfigError(option, str(directory), "expected a directory for the compile cache, not an existing file")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(option, str(directory), f"expected a directory the compile cache can be created in "
                                                  f"({e.strerror})") from e
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(option, str(directory), "expected a directory the compile cache can write to")
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # JAX's defaults keep programs that compiled in under a second out of the cache, which is most CPU
    # programs; every program goes in, whatever its size (-1: no size floor, and none set for us).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    reset_cache()  # JAX opens its cache once per process: reopen it in this directory
    return path


def disable() -> None:
    """Turns JAX's persistent compilation cache off, even where `JAX_COMPILATION_CACHE_DIR` names one."""
    import jax
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()
