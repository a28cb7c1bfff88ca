"""Every command-line entry point behaves like a real tool.

`--help` prints a usage line and exits 0; a user mistake (a mistyped key, a value of the
wrong type, a missing folder, a port in use) exits with status 2 and one message that
names the fix, never a traceback; a run is never started by accident. Most cases call
`main(argv)` in this process (a traceback there would be an exception other than
SystemExit); one test per entry point runs the real `python -m ...` command.
"""

import socket
import subprocess
import sys

import pytest
from conftest import ROOT

from stacklib.capstone import __main__ as capstone_cli
from stacklib.diffusion import train as diffusion_cli
from stacklib.grading import __main__ as grading_cli
from stacklib.infer import serve as infer_cli
from stacklib.llm import train as train_cli
from stacklib.serve import __main__ as serve_cli

MAINS = {"stacklib.llm.train": train_cli.main, "stacklib.diffusion.train": diffusion_cli.main,
         "stacklib.infer.serve": infer_cli.main,
         "stacklib.serve": serve_cli.main, "stacklib.capstone": capstone_cli.main,
         "stacklib.grading": grading_cli.main}


def exits(main, argv, capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    out, err = capsys.readouterr()
    return exit_info.value.code, out, err


@pytest.mark.parametrize("module", sorted(MAINS))
def test_help_prints_a_usage_line_and_exits_0(module, capsys):
    status, out, _ = exits(MAINS[module], ["--help"], capsys)
    assert status == 0 and out.startswith(f"usage: python -m {module}"), out


@pytest.fixture
def busy_port():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        yield taken.getsockname()[1]


def mistakes(tmp_path, busy_port):
    """(module, argv, words the one-line message must contain): user mistakes, caught before any work."""
    not_a_figure = str(tmp_path / "dashboard.txt")
    (tmp_path / "old_run").mkdir()
    (tmp_path / "old_run" / "checkpoint").write_text("")
    return [
        ("stacklib.llm.train", [], "nothing to train"),
        ("stacklib.llm.train", ["stepz=20"], "Did you mean steps?"),
        ("stacklib.llm.train", ["d_model=abc"], "it must be int"),
        ("stacklib.llm.train", ["--steps", "20"], "write steps=20 instead of --steps 20"),
        ("stacklib.llm.train", ["--steps=20"], "write steps=20"),
        ("stacklib.llm.train", ["missing.yml", "steps=3"], "config file 'missing.yml' not found"),
        ("stacklib.llm.train", ["steps=3", "seq_len=256"], "Set seq_len<=128"),
        ("stacklib.diffusion.train", [], "nothing to train"),
        ("stacklib.diffusion.train", ["objective=score"], "is not one of flow, ddpm"),
        ("stacklib.infer.serve", ["--model", "no-such-model"], "neither a zoo name"),
        ("stacklib.infer.serve", ["--port", str(busy_port)], "Choose another --port"),
        ("stacklib.infer.serve", ["--max-num-seqs", "many"], "invalid int value"),
        ("stacklib.infer.serve", ["--block-size", "0"], "block_size=0 must be a positive integer"),
        ("stacklib.infer.serve", ["--quantization", "int3"], "invalid choice: 'int3'"),
        ("stacklib.serve", [], "--model-dir"),
        ("stacklib.serve", ["--model-dir", str(tmp_path / "missing")], "does not exist"),
        ("stacklib.serve", ["--model-dir", str(tmp_path), "--max-batch-size", "0"], "must be at least 1"),
        ("stacklib.serve", ["--model-dir", str(tmp_path), "--port", str(busy_port)], "Choose another --port"),
        ("stacklib.capstone", ["--figure", not_a_figure], "ending in one of .png"),
        ("stacklib.capstone", ["--figure", str(tmp_path / "missing" / "d.png")], "does not exist"),
        ("stacklib.capstone", ["--workdir", str(tmp_path / "old_run")], "not an empty folder"),
        ("stacklib.grading", [], "required"),
        ("stacklib.grading", ["grade", str(tmp_path / "missing")], "is not a folder"),
        ("stacklib.grading", ["grade", str(tmp_path), "--time-limit", "0"], "positive number of seconds"),
        ("stacklib.grading", ["strip", str(tmp_path / "missing"), str(tmp_path)], "no solution notebooks"),
    ]


def test_user_mistakes_exit_2_with_one_message_that_names_the_fix(tmp_path, busy_port, capsys):
    for module, argv, words in mistakes(tmp_path, busy_port):
        status, out, err = exits(MAINS[module], argv, capsys)
        message = err.strip().splitlines()[-1]
        assert status == 2 and message.startswith(f"python -m {module}: error: "), (module, argv, err)
        assert words in message, (module, argv, message)
        assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("module, argv", [
    ("stacklib.llm.train", ["--steps", "20"]),
    ("stacklib.infer.serve", ["--model", "no-such-model"]),
    ("stacklib.serve", ["--model-dir", "no-such-folder"]),
    ("stacklib.capstone", ["--figure", "dashboard.txt"]),
    ("stacklib.grading", ["grade", "no-such-folder"]),
])
def test_the_real_command_exits_2_without_a_traceback(module, argv):
    done = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stderr.startswith("usage: "), done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"python -m {module}: error: ")
