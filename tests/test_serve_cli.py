"""`python -m luce_jax.serve` as a user starts it: flags checked before anything binds (one
line each), --version, the luce-serve script, the open-server warning, and Ctrl-C while the
model still compiles."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import luce_jax
from luce_jax.serve import parse_config


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--max-ctx", "x"], "--max-ctx"),
        (["--kv-pool-tokens", "256", "--max-ctx", "512"], "--kv-pool-tokens"),
        (["--dtype", "int3"], "--dtype"),
        (["--api-key", " "], "--api-key"),
    ],
)
def test_a_bad_flag_is_one_line_naming_it_before_anything_binds(capsys, argv, flag):
    with pytest.raises(SystemExit) as e:
        parse_config(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert flag in err[0] and "--help" in err[0] and "usage" not in err[0]


def test_version_and_the_console_script():
    out = subprocess.run([sys.executable, "-m", "luce_jax.serve", "--version"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0 and out.stdout.strip() == f"luce_jax {luce_jax.__version__}"
    assert luce_jax.__version__[0].isdigit()
    script = shutil.which("luce-serve")
    assert script, "pip install -e . installs the luce-serve script"
    out = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"luce_jax {luce_jax.__version__}"


def test_ctrl_c_while_compiling_exits_within_seconds_and_warns_of_an_open_server(tmp_path):
    """Bound to every address with no key: a warning. SIGINT during the start-up compile (the
    embedded model with a speculative mode compiles for minutes on CPU) ends the process
    within a few seconds, and a log that is not a terminal gets plain lines, no bar frames."""
    port = _free_port()
    cmd = [sys.executable, "-m", "luce_jax.serve", "--host", "0.0.0.0", "--port", str(port),
           "--spec-mode", "draft", "--compile-cache-dir", "", "--log-level", "info"]  # fmt: skip
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "JAX_PLATFORMS": "cpu"})  # fmt: skip
        try:
            deadline = time.monotonic() + 240
            while "compiling" not in log.read_text():
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "no compile started in 240 s"
                time.sleep(0.2)
            time.sleep(1.0)  # well inside the compile
            t0 = time.monotonic()
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert took < 10, f"exit took {took:.1f} s"
    assert "no --api-key" in text and "0.0.0.0" in text
    assert "\r" not in text


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_compile_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    """The default persistent compilation cache: LUCE_COMPILE_CACHE_DIR where set, else
    luce_jax/xla under XDG_CACHE_HOME, else under ~/.cache."""
    from luce_jax.config import EngineConfig

    monkeypatch.setenv("LUCE_COMPILE_CACHE_DIR", str(tmp_path / "c"))
    assert EngineConfig().compile_cache_dir == str(tmp_path / "c")
    monkeypatch.delenv("LUCE_COMPILE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert EngineConfig().compile_cache_dir == str(tmp_path / "luce_jax" / "xla")
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert EngineConfig().compile_cache_dir == str(Path.home() / ".cache" / "luce_jax" / "xla")
