"""One SpeculativeConfig: the same options, names and checks in LLM, the CLI, `saguaro serve`,
`saguaro bench` and the worker's handshake."""
from __future__ import annotations

from dataclasses import replace

import pytest

from saguaro.cli import build_parser
from saguaro.config import SpeculativeConfig, speculative_config_from_args
from saguaro.server.serve import build_parser as build_serve_parser

FLAGS = ["--draft", "smollm2", "-k", "3", "--prompt-lookup", "0", "--fan-out", "2,1,1,0", "--fan-out-budget", "4",
         "--saguaro-c", "0.5", "--backup", "fast", "--draft-device", "cpu", "--draft-address", "127.0.0.1:29999",
         "--acceptance-rate", "0.6", "--power-law-r", "0.7", "--proposal-top", "32"]
EXPECTED = SpeculativeConfig("ssd", "smollm2", 3, 0, [2, 1, 1, 0], 4, 0.5, "fast", "cpu", "127.0.0.1:29999", 0.6, 0.7,
                             proposal_top=32)


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
