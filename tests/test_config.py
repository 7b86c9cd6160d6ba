"""One EngineConfig and one SpeculativeConfig: the same options, names and checks in LLM, the
CLI, `saguaro serve`, `saguaro bench` and the worker's handshake."""
from __future__ import annotations

from dataclasses import replace

import pytest

from saguaro.cli import build_parser
from saguaro.config import (EngineConfig, SpeculativeConfig, engine_config_from_args, speculative_config_from_args,
                            split_options)
from saguaro.server.serve import build_parser as build_serve_parser

FLAGS = ["--draft", "smollm2", "-k", "3", "--prompt-lookup", "0", "--fan-out", "2,1,1,0", "--fan-out-budget", "4",
         "--saguaro-c", "0.5", "--backup", "fast", "--draft-device", "cpu", "--draft-address", "127.0.0.1:29999",
         "--acceptance-rate", "0.6", "--power-law-r", "0.7", "--proposal-top", "32"]
EXPECTED = SpeculativeConfig("ssd", "smollm2", 3, 0, [2, 1, 1, 0], 4, 0.5, "fast", "cpu", "127.0.0.1:29999", 0.6, 0.7,
                             proposal_top=32)

ENGINE_FLAGS = ["--model", "/models/m", "--dtype", "fp32", "--device", "cpu", "--threads", "2", "--no-batch-invariant",
                "--quantization", "int8", "-tp", "1", "--no-enable-prefix-caching", "--prefix-cache-mb", "64",
                "--max-num-seqs", "8", "--kv-cache-mb", "100"]
ENGINE_EXPECTED = EngineConfig("/models/m", "fp32", "cpu", 2, False, "int8", 1, False, 64.0, 8, 100.0)


def test_every_command_reads_the_same_options_into_the_same_config():
    parsed = {
        "generate": build_parser().parse_args(["generate", "hi", "--method", "ssd", *FLAGS]),
        "chat": build_parser().parse_args(["chat", "--method", "ssd", *FLAGS]),
        "serve": build_serve_parser().parse_args(["--method", "ssd", *FLAGS]),
        "bench": build_parser().parse_args(["bench", *FLAGS]),  # bench takes --methods instead
    }
    for command, args in parsed.items():
        method = {"method": "ssd"} if command == "bench" else {}
        assert speculative_config_from_args(args, **method) == EXPECTED, command


def test_command_defaults_are_the_config_defaults():
    args = build_serve_parser().parse_args([])
    assert speculative_config_from_args(args) == SpeculativeConfig()
    cli = build_parser().parse_args(["generate", "hi"])
    assert speculative_config_from_args(cli) == SpeculativeConfig()
    assert SpeculativeConfig().method == "auto"


def test_every_command_reads_the_same_engine_options():
    parsed = {
        "generate": build_parser().parse_args(["generate", "hi", *ENGINE_FLAGS]),
        "chat": build_parser().parse_args(["chat", *ENGINE_FLAGS]),
        "plan": build_parser().parse_args(["plan", *ENGINE_FLAGS]),
        "serve": build_serve_parser().parse_args(ENGINE_FLAGS),
    }
    for command, args in parsed.items():
        assert engine_config_from_args(args) == ENGINE_EXPECTED, command


def test_engine_defaults_are_the_config_defaults_but_the_servers_batch():
    assert engine_config_from_args(build_parser().parse_args(["generate", "hi"])) == EngineConfig()
    serve = build_serve_parser()
    assert engine_config_from_args(serve.parse_args([])) == EngineConfig(max_num_seqs=32)
    assert serve.parse_args(["--max-batch-size", "4"]).max_num_seqs == 4  # the server's older name
    assert build_parser().parse_args(["generate", "hi", "--tensor-parallel-size", "2"]).tensor_parallel_size == 2


def test_llm_options_are_split_between_the_configs():
    assert split_options({"dtype": "fp32", "method": "sd", "max_num_seqs": 4}) == (
        {"dtype": "fp32", "max_num_seqs": 4}, {"method": "sd"})
    with pytest.raises(TypeError, match="unknown option.*max_batch"):
        split_options({"max_batch": 4})


@pytest.mark.parametrize("bad, message", [
    ({"dtype": "fp8"}, "unknown dtype"),
    ({"quantization": "q3"}, "quantization"),
    ({"num_threads": 0}, "num_threads"),
    ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
    ({"tensor_parallel_size": 2, "quantization": "int8"}, "full-precision"),
    ({"prefix_cache_mb": -1}, "prefix_cache_mb"),
    ({"max_num_seqs": 0}, "max_num_seqs"),
    ({"kv_cache_mb": 0}, "kv_cache_mb"),
])
def test_bad_engine_values_are_refused_with_a_message(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**bad)


def test_prefix_caching_is_off_when_disabled_or_tensor_parallel():
    assert EngineConfig().prefix_cache_budget_mb == 512.0
    assert EngineConfig(enable_prefix_caching=False).prefix_cache_budget_mb == 0.0
    assert EngineConfig(tensor_parallel_size=2).prefix_cache_budget_mb == 0.0


def test_of_takes_a_config_a_dict_or_keywords():
    assert SpeculativeConfig.of(None, method="sd") == SpeculativeConfig(method="sd")
    assert SpeculativeConfig.of({"method": "sd", "num_speculative_tokens": 3}) == SpeculativeConfig("sd", None, 3)
    assert SpeculativeConfig.of(EXPECTED, backup="neural") == replace(EXPECTED, backup="neural")
    with pytest.raises(TypeError, match="unknown speculative option.*fanout"):
        SpeculativeConfig.of(None, fanout=[1])
    with pytest.raises(TypeError, match="SpeculativeConfig or a dict"):
        SpeculativeConfig.of("ssd")


@pytest.mark.parametrize("bad, message", [
    ({"method": "magic"}, "unknown method"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"backup": "slow"}, "backup"),
    ({"fan_out": [1, 1]}, "K\\+1"),
    ({"fan_out": "sideways"}, "geometric, uniform or K\\+1"),
    ({"fan_out_budget": -1}, "fan_out_budget"),
])
def test_bad_values_are_refused_with_a_message(bad, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig(**bad)


def test_cli_rejects_an_unknown_method():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--method", "magic"])


@pytest.mark.parametrize("fan_out", [[1, 1], [1, 1, 1, 1], [1, -1, 1], "1,1"])
def test_a_fan_out_of_the_wrong_length_or_with_negative_counts_is_refused(fan_out):
    with pytest.raises(ValueError, match="K\\+1 = 3"):
        SpeculativeConfig(num_speculative_tokens=2, fan_out=fan_out)
    assert SpeculativeConfig(num_speculative_tokens=2, fan_out="2,1,0").fan_out == [2, 1, 0]  # control
