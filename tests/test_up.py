"""`pdserve up` as a user runs it (the README's main job): starts P, D and proxy, answers, stops all."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def _children_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


def test_up_answers_then_stops_everything(tiny_model, tmp_path):
    cmd = [sys.executable, "-m", "pdserve.cli", "up", tiny_model, "--port", "0",
           "--log-dir", str(tmp_path), "--instance-args", "--num-blocks 128",
           "--decode-args", "--max-num-batched-tokens 64",
           "--ask", "The prefill server sends", "--max-tokens", "8"]
    # as in a terminal, Ctrl-C is not ignored (a test run started in the background of a
    # non-interactive shell inherits SIGINT ignored, and so would `pdserve up`)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=_sigint_default)
    lines, pids = [], []
    try:
        deadline = time.monotonic() + 120
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("answer:"):
                break
            assert time.monotonic() < deadline
        text = "".join(lines)
        assert "proxy    http://127.0.0.1:" in text and "answer:" in text, text
        assert "error" not in text.lower(), text
        # each instance runs on its own share of the cores
        cpus = {}
        for log in Path(tmp_path).glob("*.port"):
            role = log.name.split("-")[0]
            pid = _pid_listening(log)
            if pid:
                pids.append(pid)
                cpus[role] = Path(f"/proc/{pid}/status").read_text().split("Cpus_allowed_list:")[1].split()[0]
                argv = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
                assert ("--max-num-batched-tokens" in argv) == (role == "decode"), (role, argv)  # --decode-args
        if os.cpu_count() >= 2:
            assert cpus["prefill"] != cpus["decode"], cpus
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        try:  # a bound for a hang, not a speed target: up may wait 15 s per role group before a KILL
            assert proc.wait(60) == 0
        except subprocess.TimeoutExpired:
            raise AssertionError("`pdserve up` did not stop within 60 s of Ctrl-C:\n" + _logs(tmp_path)) from None
        deadline = time.monotonic() + 10
        while _children_alive(pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _children_alive(pids), "instances outlived `pdserve up`"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _logs(log_dir: Path) -> str:
    return "\n".join(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:])
                     for log in sorted(Path(log_dir).glob("*.log")))


def _pid_listening(port_file: Path) -> int | None:
    """The pid of the process whose bound port is in `port_file` (from /proc/net/tcp inodes)."""
    import json
    port = json.loads(port_file.read_text())["port"]
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
            inodes.add(fields[9])
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return int(pid)
        except OSError:
            continue
    return None


def test_instance_args_reach_every_serve(tiny_model):
    """`pdserve up --instance-args` is how a deployment's instances get serve's flags."""
    import shlex

    from pdserve.cli import build_parser
    parser = build_parser()
    up = parser.parse_args(["up", tiny_model, "--instance-args=--trust-request-chat-template --num-blocks 64"])
    serve = parser.parse_args(["serve", tiny_model, *shlex.split(up.instance_args)])
    assert serve.trust_request_chat_template
    assert not parser.parse_args(["serve", tiny_model]).trust_request_chat_template


def test_the_proxy_renders_chats_with_the_instances_chat_template():
    from pdserve.launcher import chat_template_args
    assert chat_template_args(["--num-blocks", "64", "--chat-template", "t.jinja"]) == ["--chat-template", "t.jinja"]
    assert chat_template_args(["--chat-template={{ x }}"]) == ["--chat-template", "{{ x }}"]
    assert chat_template_args(["--num-blocks", "64"]) == []


def test_decode_instances_split_local_prefills_unless_told_otherwise(tiny_model):
    """With producers, decode instances get --max-prefill-stall-s 0.1 before the user's arguments,
    which win; without producers they serve whole requests and get nothing."""
    from pdserve.cli import build_parser
    from pdserve.launcher import role_defaults
    parser = build_parser()

    def stall(role: str, user_args: list[str], with_producers: bool = True) -> float:
        args = ["serve", tiny_model, *role_defaults(role, with_producers), *user_args]
        return parser.parse_args(args).max_prefill_stall_s

    assert stall("decode", []) == 0.1 and stall("prefill", []) == 0.0
    assert stall("decode", ["--max-prefill-stall-s", "0"]) == 0.0
    assert stall("decode", [], with_producers=False) == 0.0
