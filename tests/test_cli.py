"""The command line: the demo, explain on a user's FILE.py:FACTORY, and the one-line errors for
bad arguments and for a user's file or factory that fails."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from streamfuse.cli import main


def test_cli_demo_runs_and_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "transformer_block" in out and "multibranch_conv" in out


def test_cli_explain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model_file = tmp_path / "mymodel.py"
    model_file.write_text(textwrap.dedent("""
        import torch
        def make():
            return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()), (torch.randn(2, 8),)
    """))
    assert main(["explain", f"{model_file}:make"]) == 0
    out = capsys.readouterr().out
    assert "streamfuse plan" in out and "gelu" in out
    with pytest.raises(SystemExit, match="has no callable 'nope'"):
        main(["explain", f"{model_file}:nope"])
    with pytest.raises(SystemExit, match="expected FILE.py:FACTORY"):
        main(["explain", str(model_file)])
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\ndef make():\n    return torch.nn.Linear(8, 8), 'hello'\n")
    with pytest.raises(SystemExit, match="error: FACTORY.. returned bad example inputs: .*got str"):
        main(["explain", f"{bad}:make"])
    with pytest.raises(SystemExit, match="--set takes NAME=VALUE"):  # checked before --list returns
        main(["bench", "--list", "--set", "nosuchkey=1"])
    # the user's file failing, a file that is not Python, a count below 1: one line, no traceback
    # (helper sweep, session 41)
    (tmp_path / "raises.py").write_text("raise RuntimeError('broken import')\n")
    with pytest.raises(SystemExit, match="importing .*raises.py raised RuntimeError: broken import"):
        main(["explain", f"{tmp_path / 'raises.py'}:make"])
    (tmp_path / "factory.py").write_text("def make():\n    raise KeyError('weights')\n")
    with pytest.raises(SystemExit, match="FACTORY .*factory.py:make raised KeyError: 'weights'"):
        main(["explain", f"{tmp_path / 'factory.py'}:make"])
    (tmp_path / "model.txt").write_text("x")
    with pytest.raises(SystemExit, match="FILE must be a Python file"):
        main(["explain", f"{tmp_path / 'model.txt'}:make"])
    for argv in (["profile", f"{model_file}:make", "--calls", "-3"], ["bench", "--list", "--reps", "0"]):
        with pytest.raises(SystemExit):
            main(argv)
        assert "expected a whole number of at least 1" in capsys.readouterr().err
