"""What `pegainfer-server` answers before it loads anything: `--help` and a busy port come back
without importing torch or a plugin (seconds on a busy machine), a busy port in one line."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Run the CLI's main in a fresh interpreter; report whether torch was imported."""
    code = textwrap.dedent(f"""
        import sys
        from pegainfer.server.cli import main
        try:
            code = main({list(args)!r})
        except SystemExit as exc:
            code = exc.code
        print("torch imported:", "torch" in sys.modules)
        sys.exit(code)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_help_does_not_import_torch():
    done = run_cli("--help")
    assert done.returncode == 0, done.stderr
    assert "--model-path" in done.stdout
    assert "torch imported: False" in done.stdout


def test_a_busy_port_fails_at_once_in_one_line(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli("--model-path", str(tmp_path), "--host", "127.0.0.1", "--port", str(port))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"pegainfer-server: cannot listen on 127.0.0.1:{port}: Address already in use"
    ]
    assert "torch imported: False" in done.stdout


def test_the_engine_process_starts_before_torch_is_imported(tmp_path):
    """The engine process imports torch and loads while the server imports its own modules."""
    code = textwrap.dedent(f"""
        import sys
        from pegainfer.server import cli

        def spawn_engine(args, log_format):
            print("torch imported at spawn:", "torch" in sys.modules)
            sys.exit(3)

        cli.spawn_engine = spawn_engine
        sys.exit(cli.main(["--model-path", {str(tmp_path)!r}, "--port", "0"]))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stdout.strip() == "torch imported at spawn: False"
