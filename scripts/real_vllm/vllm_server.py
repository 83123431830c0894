"""Start, stop and restart a real vLLM (CPU) server for the real-engine tests.

Runs with the project's own Python (standard library only); vLLM itself runs with the
cached virtual environment's Python. Used by ``scripts/test-real-vllm`` and, for the
kill-and-restart test, by ``tests/real_engines``.

    python scripts/real_vllm/vllm_server.py start --state-dir D --venv V --model M \\
        [--dp-size 2] [--hash-mode int|bytes] [--num-blocks 20] [--max-model-len 512]
    python scripts/real_vllm/vllm_server.py stop --state-dir D
    python scripts/real_vllm/vllm_server.py env --state-dir D [--prefix P]  # exports for the tests

State lives in ``D/server.json`` (how to start it again, where it listens) and
``D/vllm.pid`` (the process group of the running server). vLLM runs in its own process
group (its engine-core processes included), so ``stop`` ends all of it with one
``killpg``: SIGTERM, then SIGKILL after a deadline; no orphan survives.

Ports: the HTTP port and the two event port ranges (live ``base..base+dp-1`` and replay)
are chosen free on this machine at ``start`` and kept in the state file, so a restart
reuses them, as a restarted engine would.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

STATE_FILE = "server.json"
PID_FILE = "vllm.pid"
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 30.0
BLOCK_SIZE = 32  # vLLM on CPU needs a multiple of 32
TOPIC = "kv"
# The tiny model has no chat template of its own; this one keeps the word-level
# vocabulary (role markers are words too: system w4, user w5, assistant w6), so a test
# knows a chat's token ids. Each turn's prompt extends the previous turn's.
CHAT_TEMPLATE = (
    "{% set marks = {'system': 'w4', 'user': 'w5', 'assistant': 'w6'} %}"
    "{% for m in messages %}{{ marks[m['role']] }} {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}w6 {% endif %}"
)

# vLLM is started detached (see start()): a shell in a new session puts it in the
# background and exits, so no process that starts a server is ever its parent. The tests'
# process restarts vLLM and leaves it running for the script to stop; a Popen of it
# would warn at that process's exit, and a child killed by stop() would stay a zombie
# until reaped. Its output goes to the log; $! is the launcher's answer.
_LAUNCH = 'log=$1; shift; "$@" >>"$log" 2>&1 </dev/null & echo $!'


@dataclass
class ServerSpec:
    """Everything needed to start the same server again, and to reach it."""

    venv: str
    model: str
    state_dir: str
    dp_size: int
    hash_mode: str  # "int" (uint64 hashes) or "bytes" (32-byte hashes)
    num_blocks: int
    max_model_len: int
    http_port: int
    kv_port_base: int
    replay_port_base: int
    host: str = "127.0.0.1"
    block_size: int = BLOCK_SIZE
    topic: str = TOPIC
    extra_args: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def chat_template_path(self) -> Path:
        return Path(self.state_dir) / "chat-template.jinja"

    @property
    def log_path(self) -> Path:
        return Path(self.state_dir) / f"vllm-{self.hash_mode}.log"

    def kv_events_config(self) -> dict[str, object]:
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.kv_port_base}",
            "replay_endpoint": f"tcp://*:{self.replay_port_base}",
            "topic": self.topic,
        }

    def argv(self) -> list[str]:
        return [
            str(Path(self.venv) / "bin" / "python"),
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--served-model-name",
            "tiny",
            "--host",
            self.host,
            "--port",
            str(self.http_port),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--max-model-len",
            str(self.max_model_len),
            "--block-size",
            str(self.block_size),
            "--enforce-eager",
            "--num-gpu-blocks-override",
            str(self.num_blocks),
            "--data-parallel-size",
            str(self.dp_size),
            "--kv-events-config",
            json.dumps(self.kv_events_config()),
            "--chat-template",
            str(self.chat_template_path),
            *self.extra_args,
        ]

    def env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "PYTHONSTARTUP")
        }
        env.update(
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            VLLM_CPU_KVCACHE_SPACE="1",
            VLLM_CACHE_ROOT=str(Path(self.state_dir) / "vllm-cache"),
            VLLM_SERVER_DEV_MODE="1",  # adds POST /reset_prefix_cache
            VLLM_NO_USAGE_STATS="1",
            DO_NOT_TRACK="1",
            VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="1" if self.hash_mode == "int" else "0",
        )
        return env


def default_cache() -> Path:
    """Where scripts/test-real-vllm keeps the venv and the model: ``$KVEVENTS_CACHE``,
    else ``~/.cache/kvevents``."""
    return Path(os.environ.get("KVEVENTS_CACHE") or Path.home() / ".cache" / "kvevents")


def save_spec(spec: ServerSpec) -> None:
    path = Path(spec.state_dir) / STATE_FILE
    path.write_text(json.dumps(asdict(spec), indent=2))


def load_spec(state_dir: str | Path) -> ServerSpec:
    path = Path(state_dir) / STATE_FILE
    if not path.exists():
        raise SystemExit(f"no vLLM state in {path}: run `vllm_server.py start` first")
    return ServerSpec(**json.loads(path.read_text()))


# --- ports -------------------------------------------------------------------------------


def _port_free(port: int) -> bool:
    """True when ``port`` can be bound on every interface (vLLM binds ``tcp://*``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def free_port_range(count: int, avoid: set[int], rng: random.Random) -> int:
    """A base port such that ``base..base+count-1`` are free now and not in ``avoid``."""
    for _ in range(500):
        base = rng.randrange(20_000, 60_000 - count)
        ports = range(base, base + count)
        if avoid.isdisjoint(ports) and all(_port_free(p) for p in ports):
            return base
    raise SystemExit(f"could not find {count} consecutive free ports in 20000-60000")


def choose_ports(dp_size: int) -> tuple[int, int, int]:
    """(http_port, kv_port_base, replay_port_base), all free and non-overlapping."""
    rng = random.Random()
    http = free_port_range(1, set(), rng)
    kv = free_port_range(dp_size, {http}, rng)
    replay = free_port_range(dp_size, {http, *range(kv, kv + dp_size)}, rng)
    return http, kv, replay


# --- process control ---------------------------------------------------------------------


def _read_pgid(state_dir: str | Path) -> int | None:
    path = Path(state_dir) / PID_FILE
    if not path.exists():
        return None
    text = path.read_text().strip()
    return int(text) if text.isdigit() else None


def _session_of(pid: int) -> int:
    """The process group of ``pid`` (the launcher's session: vLLM's group); ``pid`` itself
    when it has already exited (its group is then gone too, and wait_ready says so)."""
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return pid


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) succeeds while any member (even a zombie) is left; look for live ones.
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # fields after the command name, which is in parentheses and may hold spaces
        rest = stat.rsplit(")", 1)[1].split()
        state, pg = rest[0], int(rest[2])
        if pg == pgid and state != "Z":
            return True
    return False


def stop(
    state_dir: str | Path, *, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S
) -> bool:
    """Stop the server's whole process group; SIGKILL after ``timeout``. True if one ran."""
    pgid = _read_pgid(state_dir)
    if pgid is None:
        return False
    ran = _group_alive(pgid)
    if ran:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + timeout
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
            deadline = time.monotonic() + 10.0
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.1)
    (Path(state_dir) / PID_FILE).unlink(missing_ok=True)
    return ran


def _log_tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return f"(no log at {path})"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def wait_ready(spec: ServerSpec, timeout: float) -> float:
    """Block until ``GET /v1/models`` answers 200; return seconds waited.

    Fails (SystemExit with the log's tail) when the server's process group is gone or
    the deadline passes.
    """
    start = time.monotonic()
    deadline = start + timeout
    pgid = _read_pgid(spec.state_dir)
    while True:
        if pgid is not None and not _group_alive(pgid):
            raise SystemExit(
                f"vLLM died while starting; log {spec.log_path}:\n" + _log_tail(spec.log_path)
            )
        try:
            with urllib.request.urlopen(f"{spec.url}/v1/models", timeout=2.0) as resp:
                if resp.status == 200:
                    return time.monotonic() - start
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(
                f"vLLM not ready at {spec.url} after {timeout:.0f} s; log {spec.log_path}:\n"
                + _log_tail(spec.log_path)
            )
        time.sleep(0.5)


def start(spec: ServerSpec, *, timeout: float = READY_TIMEOUT_S) -> float:
    """Start vLLM in its own process group, wait until ready; return the start time in s."""
    state = Path(spec.state_dir)
    state.mkdir(parents=True, exist_ok=True)
    if (pgid := _read_pgid(state)) is not None and _group_alive(pgid):
        raise SystemExit(
            f"a vLLM (process group {pgid}) is already running for {state}: stop it first"
        )
    save_spec(spec)
    spec.chat_template_path.write_text(CHAT_TEMPLATE)
    with spec.log_path.open("ab") as log:
        log.write(f"\n=== start {time.strftime('%H:%M:%S')}: {shlex.join(spec.argv())}\n".encode())
    # The launcher leads a new session, so its process group (its pid) is vLLM's too, the
    # engine cores included: one killpg stops them all. It exits at once (see _LAUNCH).
    launcher = subprocess.run(
        ["/bin/sh", "-c", _LAUNCH, "vllm-launcher", str(spec.log_path), *spec.argv()],
        env=spec.env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=30.0,
        start_new_session=True,
        check=False,
    )
    if launcher.returncode != 0 or not launcher.stdout.strip().isdigit():
        raise SystemExit(
            f"could not launch vLLM (the launcher exited {launcher.returncode}: "
            f"{launcher.stderr.strip() or launcher.stdout.strip()}); log {spec.log_path}"
        )
    (state / PID_FILE).write_text(str(_session_of(int(launcher.stdout))))
    try:
        return wait_ready(spec, timeout)
    except BaseException:
        stop(state, timeout=5.0)
        raise


def restart(state_dir: str | Path, *, sig: int = signal.SIGKILL) -> float:
    """Kill the running server (SIGKILL by default: a crash) and start it again, same ports."""
    spec = load_spec(state_dir)
    stop(state_dir, sig=sig)
    return start(spec)


def memory(state_dir: str | Path) -> str:
    """The running server's memory: proportional set size (shared pages split between
    the processes that map them) and plain resident size, summed over its process group."""
    pgid = _read_pgid(state_dir)
    if pgid is None or not _group_alive(pgid):
        return "not running"
    pss_kb = rss_kb = procs = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(rest[2]) != pgid:
                continue
            rollup = (entry / "smaps_rollup").read_text()
        except OSError:
            continue
        procs += 1
        for line in rollup.splitlines():
            key, _, value = line.partition(":")
            if key == "Pss":
                pss_kb += int(value.split()[0])
            elif key == "Rss":
                rss_kb += int(value.split()[0])
    return f"{pss_kb / 2**20:.1f} GiB PSS ({rss_kb / 2**20:.1f} GiB RSS) in {procs} processes"


ENV_PREFIX = "KVEVENTS_REAL_VLLM_"


def shell_env(spec: ServerSpec, prefix: str = ENV_PREFIX) -> dict[str, str]:
    """The environment variables that tell ``tests/real_engines`` where vLLM is; a P/D
    run names its two instances apart (``KVEVENTS_REAL_VLLM_PREFILL_URL``...)."""
    values = {
        "URL": spec.url,
        "KV_ENDPOINT": f"tcp://{spec.host}:{spec.kv_port_base}",
        "REPLAY_ENDPOINT": f"tcp://{spec.host}:{spec.replay_port_base}",
        "DP_SIZE": str(spec.dp_size),
        "MODEL": spec.model,
        "BLOCK_SIZE": str(spec.block_size),
        "NUM_BLOCKS": str(spec.num_blocks),
        "TOPIC": spec.topic,
        "HASH_MODE": spec.hash_mode,
        "STATE": str(Path(spec.state_dir).resolve()),
    }
    return {prefix + key: value for key, value in values.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="start/stop a real vLLM for tests/real_engines")
    sub = parser.add_subparsers(dest="command", required=True)
    p_start = sub.add_parser("start", help="start vLLM and wait until it serves")
    p_start.add_argument("--state-dir", required=True)
    p_start.add_argument("--venv", required=True)
    p_start.add_argument("--model", required=True)
    p_start.add_argument("--dp-size", type=int, default=2)
    p_start.add_argument("--hash-mode", choices=("int", "bytes"), default="int")
    p_start.add_argument("--num-blocks", type=int, default=20)
    p_start.add_argument("--max-model-len", type=int, default=512)
    p_start.add_argument("--timeout", type=float, default=READY_TIMEOUT_S)
    p_start.add_argument("extra", nargs="*", help="more vLLM flags, after --")
    for name in ("stop", "restart", "env", "memory"):
        p = sub.add_parser(name)
        p.add_argument("--state-dir", required=True)
        if name == "env":
            p.add_argument(
                "--prefix", default=ENV_PREFIX, help=f"of every variable (default {ENV_PREFIX})"
            )
    args = parser.parse_args(argv)

    if args.command == "start":
        http, kv, replay = choose_ports(args.dp_size)
        spec = ServerSpec(
            venv=str(Path(args.venv).resolve()),
            model=str(Path(args.model).resolve()),
            state_dir=str(Path(args.state_dir).resolve()),
            dp_size=args.dp_size,
            hash_mode=args.hash_mode,
            num_blocks=args.num_blocks,
            max_model_len=args.max_model_len,
            http_port=http,
            kv_port_base=kv,
            replay_port_base=replay,
            extra_args=list(args.extra),
        )
        took = start(spec, timeout=args.timeout)
        print(
            f"vLLM ready at {spec.url} in {took:.1f} s (dp {spec.dp_size}, {spec.hash_mode} hashes, "
            f"events tcp://*:{kv}+r, replay tcp://*:{replay}+r; log {spec.log_path})"
        )
    elif args.command == "stop":
        print("vLLM stopped" if stop(args.state_dir) else "no vLLM was running")
    elif args.command == "restart":
        print(f"vLLM restarted in {restart(args.state_dir):.1f} s")
    elif args.command == "memory":
        print(memory(args.state_dir))
    elif args.command == "env":
        for key, value in shell_env(load_spec(args.state_dir), args.prefix).items():
            print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
