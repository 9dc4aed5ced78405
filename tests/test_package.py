import importlib

import dsv41


def test_kernels_are_installed_as_dsv41_kernels():
    mod = importlib.import_module("dsv41.kernels")
    assert mod.__name__ == "dsv41.kernels" and mod.__file__.endswith("kernels/__init__.py")


def test_public_api():
    for name in ("load_config", "layer_plan", "kv_bytes_per_token", "ConfigError", "init_params", "forward", "init_cache", "prefill", "decode",
                 "config_from_transformers", "params_from_transformers"):
        assert callable(getattr(dsv41, name)), name
