"""`pagoda serve` flags and `--config` files as the engine receives them (no server started)."""

import pytest

from engine.config import EngineConfig
from server.cli import build_parser, engine_args_from, parse_serve_args


def _engine_config(argv: list[str]) -> EngineConfig:
    ns = parse_serve_args(build_parser(), ["serve", *argv])
    return EngineConfig.from_engine_args(model=ns.model, **engine_args_from(ns))


def test_prefix_caching_is_on_by_default():
    assert _engine_config([]).cache.enable_prefix_caching is True


def test_no_prefix_caching_flag_turns_it_off():
    assert _engine_config(["--no-prefix-caching"]).cache.enable_prefix_caching is False


@pytest.mark.parametrize("key", ["enable-prefix-caching", "enable_prefix_caching"])
def test_config_file_turns_it_off(tmp_path, key):
    path = tmp_path / "serve.yaml"
    path.write_text(f"{key}: false\nblock-size: 32\n")
    config = _engine_config(["--config", str(path)])
    assert config.cache.enable_prefix_caching is False
    assert config.cache.block_size == 32


def test_config_file_switch_must_be_a_boolean(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text('enable-prefix-caching: "false"\n')
    with pytest.raises(ValueError, match="enable-prefix-caching"):
        _engine_config(["--config", str(path)])


@pytest.mark.parametrize(("argv", "yaml", "cpu", "triton"), [
    ([], None, True, False),  # not set: on for the C++ CPU kernels, off on the Triton backend
    (["--batch-invariant"], None, True, True),
    (["--no-batch-invariant"], None, False, False),
    ([], "batch-invariant: false\n", False, False),
    ([], "batch-invariant: true\n", True, True),
])
def test_batch_invariance_is_on_by_default_on_the_cpp_cpu_kernels(tmp_path, argv, yaml, cpu, triton):
    import torch

    if yaml is not None:
        path = tmp_path / "serve.yaml"
        path.write_text(yaml)
        argv = [*argv, "--config", str(path)]
    kernel = _engine_config(argv).kernel
    assert kernel.batch_invariant_for(torch.device("cpu")) is cpu
    assert kernel.batch_invariant_for(torch.device("cuda")) is triton
    kernel.kernel_backend = "triton"  # the Triton interpreter on a CPU: the GPU's default, off unless asked
    assert kernel.batch_invariant_for(torch.device("cpu")) is triton
