"""`quantpack convert` on the command line: options, --json, every bad input (exit 2, one line, no
traceback, nothing half-written), kill -9 midway and resume, disk full, and the memory bound."""
import http.server
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from click.testing import CliRunner

from quantpack.checkpoint import SourceCheckpoint, read_safetensors_header
from quantpack.checkpoint.writer import shard_name, write_safetensors
from quantpack.cli import cli
from quantpack.tiny import make_random_checkpoint

CLI = [sys.executable, "-c", "from quantpack.cli import main; main()"]
# The same CLI with every layer's quantization slowed by 20 ms (336 layers: 7 s or more), so a test that
# interrupts a conversion midway cannot lose the race to a fast or briefly descheduled run finishing first;
# and with Ctrl-C's default handler, which Python skips when it starts with SIGINT ignored (as a shell's
# background job, e.g. CI run with `&`, starts its children).
SLOW_CLI = [sys.executable, "-c", "import signal, time, quantpack.convert.writer as c; q = c._quantize_layer; "
            "signal.signal(signal.SIGINT, signal.default_int_handler); "
            "c._quantize_layer = lambda *a, **k: (time.sleep(0.02), q(*a, **k))[1]; "
            "from quantpack.cli import main; main()"]


def run_cli(*args):
    return CliRunner().invoke(cli, ["convert", *map(str, args)])


def run_subprocess(*args, env=None, timeout=300, **kwargs):
    return subprocess.run([*CLI, "convert", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout, **kwargs)


def assert_usage_failure(result, match, out=None):
    """Exit code 2, one line on stderr naming the problem, no traceback, no output left behind."""
    stderr = result.stderr
    code = result.returncode if hasattr(result, "returncode") else result.exit_code
    assert code == 2, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), stderr
    assert match in lines[0], lines[0]
    assert "Traceback" not in stderr
    if out is not None:
        assert not out.exists()
        assert not [p for p in out.parent.glob(f".{out.name}*") if (p / "quantpack.json").exists()]


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory):
    """A 110 MB float32 Llama (48 layers, no tensor above 0.5 MB) with random weights."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=48, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=512, architectures=["LlamaForCausalLM"])
    return make_random_checkpoint(tmp_path_factory.mktemp("random-llama") / "random-llama", config,
                                  dtype=torch.float32, max_shard_size="20MB")


def test_cli_convert_json(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    result = run_cli(tiny_llama_dir, "-o", out, "--method", "rtn", "--group-size", "64", "--bits-for", "down_proj=8",
                     "--skip", "layers.1.self_attn.q_proj", "--max-shard-size", "100KB", "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["layers_quantized"] == 13 and summary["layers_skipped"] == 2
    assert summary["num_shards"] >= 3 and summary["output_bytes"] > 0 and summary["throughput_bytes_per_s"] > 0
    assert summary["compression_ratio"] > 2 and 0 < summary["mean_rel_error"] <= summary["worst_rel_error"] < 0.2
    assert {l["name"]: l["bits"] for l in summary["layers"]}["model.layers.0.mlp.down_proj"] == 8
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["group_size"] == 64 and qc["method"] == "rtn"


def test_cli_table_and_dry_run(tiny_llama_dir, tmp_path):
    result = run_cli(tiny_llama_dir, "-o", tmp_path / "plan", "--dry-run", "--group-size", "none", "--bits", "8")
    assert result.exit_code == 0, result.output
    assert "quantize  model.layers.1.mlp.down_proj" in result.stdout and "8-bit, group 256" in result.stdout
    assert "keep      lm_head" in result.stdout and "(estimated)" in result.stdout and "disk free" in result.stdout
    assert list(tmp_path.iterdir()) == []
    result = run_cli(tiny_llama_dir, "-o", tmp_path / "real", "--method", "rtn", "--no-progress")
    assert result.exit_code == 0, result.output
    assert re.search(r"^layers quantized +14$", result.stdout, re.M)
    assert re.search(r"^layers skipped +1\n +1 x output embeddings", result.stdout, re.M)
    for label in ("size before", "size after", "compression", "mean layer error", "worst layer error", "time",
                  "throughput"):
        assert re.search(rf"^{label} +\S", result.stdout, re.M), label


def run_on_a_terminal(args, timeout=300):
    """Run the CLI with stderr on a pseudo-terminal (stdout a pipe); returns (code, stdout, stderr)."""
    import fcntl
    import pty
    import struct
    import termios

    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a new pty is 0 columns wide
    proc = subprocess.Popen([*CLI, *map(str, args)], stdout=subprocess.PIPE, stderr=sub, text=True)
    os.close(sub)
    chunks = []
    reader = threading.Thread(target=lambda: chunks.extend(iter(lambda: _read_pty(main), b"")), daemon=True)
    reader.start()
    stdout, _ = proc.communicate(timeout=timeout)
    reader.join(timeout=10)
    os.close(main)
    return proc.returncode, stdout, b"".join(chunks).decode(errors="replace")


def _read_pty(fd):
    try:
        return os.read(fd, 4096)
    except OSError:  # EIO: the other side closed
        return b""


def test_progress_only_on_a_terminal(tiny_encoder_dir, tmp_path):
    result = run_cli(tiny_encoder_dir, "-o", tmp_path / "enc", "--method", "rtn", "--dtype", "float16")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # not a terminal: no bar, no redraws filling a log
    code, stdout, stderr = run_on_a_terminal(["convert", tiny_encoder_dir, "-o", tmp_path / "tty", "--method", "rtn",
                                              "--dtype", "float16"])
    assert code == 0, stderr
    assert "converting" in stderr and "B/s" in stderr  # tqdm byte bar
    assert re.search(r"^layers quantized +13$", stdout, re.M)
    code, stdout, stderr = run_on_a_terminal(["verify", tmp_path / "tty", "--no-reference"])
    assert code == 0, stderr
    assert "verifying" in stderr and "3/3" in stderr and "verdict    PASS" in stdout


# ---------------------------------------------------------------------------------------------- bad input


@pytest.fixture
def src(tiny_llama_dir, tmp_path):
    return shutil.copytree(tiny_llama_dir, tmp_path / "src")


def test_bad_not_a_checkpoint(tmp_path):
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "README.md").write_text("hi")
    out = tmp_path / "out"
    assert_usage_failure(run_cli(tmp_path / "notes", "-o", out), "is not a checkpoint", out=out)
    assert_usage_failure(run_cli(tmp_path / "missing-dir", "-o", out), "no such directory", out=out)


def test_bad_truncated_safetensors(src, tmp_path):
    shard = src / shard_name(2, 2)
    shard.write_bytes(shard.read_bytes()[:5000])
    out = tmp_path / "out"
    assert_usage_failure(run_cli(src, "-o", out), "safetensors file is truncated", out=out)


def test_bad_safetensors_with_trailing_bytes(src, tmp_path):
    shard = src / shard_name(2, 2)
    shard.write_bytes(shard.read_bytes() + b"extra")
    out = tmp_path / "out"
    assert_usage_failure(run_cli(src, "-o", out), "safetensors file has trailing bytes (", out=out)


def test_bad_corrupt_safetensors(src, tmp_path):
    shard = src / shard_name(1, 2)
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\x00garbage"
    shard.write_bytes(bytes(data))
    out = tmp_path / "out"
    assert_usage_failure(run_cli(src, "-o", out), "corrupt safetensors header", out=out)


def test_bad_lfs_pointer(src, tmp_path):
    (src / shard_name(1, 2)).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:"
                                        + "a" * 64 + "\nsize 1083968\n")
    out = tmp_path / "out"
    assert_usage_failure(run_cli(src, "-o", out), "git-LFS pointer, not the weights; run `git lfs pull`", out=out)


def test_bad_index_missing_shard(src, tmp_path):
    (src / shard_name(2, 2)).unlink()
    out = tmp_path / "out"
    assert_usage_failure(run_cli(src, "-o", out), "names shard model-00002-of-00002.safetensors which is missing",
                         out=out)


def test_bad_bin_without_allow_pickle(tiny_llama_dir, tmp_path):
    src = tmp_path / "bin"
    src.mkdir()
    ref = SourceCheckpoint(tiny_llama_dir)
    torch.save({n: ref.get(n) for n in ref.tensors}, src / "pytorch_model.bin")
    shutil.copy(tiny_llama_dir / "config.json", src / "config.json")
    out = tmp_path / "out"
    assert_usage_failure(run_cli(src, "-o", out), "pass --allow-pickle", out=out)
    assert run_cli(src, "-o", out, "--allow-pickle", "--method", "rtn").exit_code == 0


def test_bad_group_size_strict(tmp_path):
    from quantpack.tiny import make_tiny_llama

    src = make_tiny_llama(tmp_path / "odd", intermediate_size=192)
    out = tmp_path / "out"
    assert_usage_failure(run_cli(src, "-o", out, "--strict", "--method", "rtn"),
                         "model.layers.0.mlp.down_proj: group_size=128 does not divide in_features K=192", out=out)
    result = run_cli(src, "-o", out, "--method", "rtn")  # without --strict: skipped with a listed warning
    assert result.exit_code == 0
    assert "warning: skipped model.layers.0.mlp.down_proj: group_size=128 does not divide" in result.stderr
    assert "warning" not in result.stdout  # stdout is the summary only
    # --quiet: no summary, no progress; the warnings still say what was skipped
    result = run_cli(src, "-o", tmp_path / "quiet", "--method", "rtn", "--quiet")
    assert result.exit_code == 0 and result.stdout == ""
    assert result.stderr.splitlines() == [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(result.stderr.splitlines()) == 2


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e5m2])
def test_bad_integer_or_fp8_weights(src, tmp_path, dtype):
    shard = src / shard_name(1, 2)
    infos, meta = read_safetensors_header(shard)
    with SourceCheckpoint(src) as ckpt:
        tensors = {n: ckpt.get(n) for n in infos}
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors[name] = tensors[name].to(dtype)
    write_safetensors(shard, tensors, meta)
    out = tmp_path / "out"
    assert_usage_failure(run_cli(src, "-o", out), f"{name} has dtype", out=out)


def test_bad_output_not_writable(tiny_llama_dir, tmp_path):
    (tmp_path / "a-file").write_text("x")
    out = tmp_path / "a-file" / "out"
    assert_usage_failure(run_cli(tiny_llama_dir, "-o", out), "is not a directory")
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(0o555)
        try:
            assert_usage_failure(run_cli(tiny_llama_dir, "-o", locked / "out"), "cannot create", out=locked / "out")
        finally:
            locked.chmod(0o755)


def tree(path):
    """Every file and folder under ``path`` with its bytes, to show that nothing changed."""
    return {str(p.relative_to(path)): (p.read_bytes() if p.is_file() else None) for p in sorted(path.rglob("*"))}


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_bad_existing_output_that_quantpack_did_not_write(tiny_llama_dir, tmp_path, overwrite):
    out = tmp_path / "precious"
    (out / "chapter").mkdir(parents=True)
    (out / "thesis.txt").write_text("mine")
    (out / "chapter" / "1.txt").write_text("also mine")
    before = tree(out)
    result = run_cli(tiny_llama_dir, "-o", out, *overwrite)
    assert_usage_failure(result, "already exists and is not a quantpack output")
    assert "--overwrite" not in result.stderr  # the flag would not help: never suggest it
    assert tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious"]


def test_overwrite_refuses_the_current_directory(src, tmp_path, monkeypatch):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "notes.txt").write_text("mine")
    before = tree(work)
    monkeypatch.chdir(work)
    assert_usage_failure(run_cli(src, "-o", ".", "--overwrite"), "is the current directory")
    monkeypatch.chdir(work / "sub")
    assert_usage_failure(run_cli(src, "-o", "..", "--overwrite"), "contains the current directory")
    assert tree(work) == before


def test_overwrite_refuses_the_source_and_what_holds_it(tiny_llama_dir, tmp_path):
    holder = tmp_path / "models"
    source = shutil.copytree(tiny_llama_dir, holder / "llama")
    (tmp_path / "link").symlink_to(source)
    before = tree(tmp_path)
    assert_usage_failure(run_cli(source, "-o", holder, "--overwrite"), f"contains the source checkpoint {source}")
    assert_usage_failure(run_cli(tmp_path / "link", "-o", source, "--overwrite"), "is the source checkpoint")
    assert_usage_failure(run_cli(source, "-o", tmp_path / "link", "--overwrite"), "is a symbolic link")
    assert tree(tmp_path) == before


def test_overwrite_replaces_a_previous_output_and_an_empty_folder_is_used(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    assert run_cli(tiny_llama_dir, "-o", out, "--method", "rtn", "--json").exit_code == 0
    assert_usage_failure(run_cli(tiny_llama_dir, "-o", out, "--bits", "8"),
                         "already exists (a finished conversion); pass --overwrite")
    result = run_cli(tiny_llama_dir, "-o", out, "--bits", "8", "--method", "rtn", "--overwrite", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bits"] == 8
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_bad_options_are_one_line(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    # each names the command-line option, never the library argument behind it
    assert_usage_failure(run_cli(tiny_llama_dir, "-o", out, "--bits-for", "down_proj=5"),
                         "Invalid value for '--bits-for': 'down_proj=5' is not REGEX=BITS with a valid REGEX and BITS "
                         "4 or 8", out=out)
    assert_usage_failure(run_cli(tiny_llama_dir, "-o", out, "--skip", "(oops"),
                         "Invalid value for '--skip': '(oops' is not a valid regular expression", out=out)
    assert_usage_failure(run_cli(tiny_llama_dir, "-o", out, "--max-shard-size", "huge"),
                         "Invalid value for '--max-shard-size': 'huge' is not a positive size", out=out)
    assert_usage_failure(run_cli(tiny_llama_dir, "-o", out, "--group-size", "48"),
                         "Invalid value for '--group-size': 48 is not a power of two from 16 to 1024, or 'none'",
                         out=out)
    assert_usage_failure(run_cli(tiny_llama_dir, "-o", out, "--revision", "v1"), "applies to hub repos", out=out)


def test_bad_offline_nothing_cached(hub_cache, tmp_path):
    out = tmp_path / "out"
    result = run_cli("someone/never-downloaded", "-o", out)
    assert_usage_failure(result, "is not in the Hugging Face cache and HF_HUB_OFFLINE is set", out=out)
    # ... while the cached repo converts offline, by repo id.
    result = run_cli(hub_cache.repo_id, "-o", out, "--method", "rtn", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["revision"] == hub_cache.commit


class _NoSuchRepoHub(http.server.BaseHTTPRequestHandler):
    """Answers like the Hugging Face Hub for a repository that does not exist."""

    def do_GET(self):
        self.send_response(404)
        self.send_header("X-Error-Code", "RepoNotFound")
        self.send_header("X-Error-Message", "Repository not found")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, *args):
        pass


def test_bad_repo_does_not_exist(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoSuchRepoHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_port}", "HF_HUB_OFFLINE": "0",
           "HF_HUB_CACHE": str(tmp_path / "cache")}
    out = tmp_path / "out"
    try:
        result = run_subprocess("nobody/no-such-model", "-o", out, env=env, timeout=120)
    finally:
        server.shutdown()
    assert_usage_failure(result, "repository nobody/no-such-model not found on the Hugging Face Hub", out=out)


def _limit_file_size(limit):
    def preexec():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing us
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


def test_disk_full_while_writing_then_resume(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    args = (tiny_llama_dir, "-o", out, "--method", "rtn", "--max-shard-size", "120KB", "--no-progress")
    result = run_subprocess(*args, preexec_fn=_limit_file_size(100_000))
    assert_usage_failure(result, "disk full while writing", out=out)
    partial = tmp_path / ".out.qp-partial"
    assert not list(partial.glob("*.tmp"))  # the half-written shard was removed
    result = run_cli(*args, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["resumed_shards"] == 0  # the failure came before any shard was finished
    assert (out / "quantpack.json").exists()


# ---------------------------------------------------------------------------------------------- crash safety


def test_kill_midway_and_resume_byte_identical(random_llama, tmp_path):
    args = ("--method", "rtn", "--max-shard-size", "1MB", "--no-progress")
    fresh = tmp_path / "fresh"
    assert run_cli(random_llama, "-o", fresh, *args).exit_code == 0

    out = tmp_path / "out"
    partial = tmp_path / ".out.qp-partial"
    proc = subprocess.Popen([*SLOW_CLI, "convert", str(random_llama), "-o", str(out), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    finished = 0
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            finished = len(json.loads((partial / "progress.json").read_text())["shards"])
        except (OSError, ValueError):
            finished = 0
        if finished >= 2:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "conversion finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not out.exists()
    assert not (partial / "quantpack.json").exists() and not (partial / "config.json").exists()

    result = run_cli(random_llama, "-o", out, *args, "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["resumed_shards"] >= 2 and summary["num_shards"] > summary["resumed_shards"]
    assert not partial.exists()
    files = sorted(p.name for p in fresh.iterdir())
    assert files == sorted(p.name for p in out.iterdir())
    for name in files:
        assert (fresh / name).read_bytes() == (out / name).read_bytes(), name
    # A finished output is never overwritten without --overwrite.
    assert_usage_failure(run_cli(random_llama, "-o", out, *args), "already exists (a finished conversion)")


MEMORY_PROBE = """
import json, sys
from quantpack.convert import convert

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024

big, tiny, out = sys.argv[1:4]
convert(tiny, out + "-warmup", method="rtn", max_shard_size="2MB", progress=False)  # imports, allocator warm-up
open("/proc/self/clear_refs", "w").write("5")  # reset the peak RSS (VmHWM) to the current RSS
base = status("VmRSS")
summary = convert(big, out, method="rtn", max_shard_size="2MB", progress=False)
print(json.dumps({"base": base, "peak": status("VmHWM"), "source_bytes": summary.source_bytes,
                  "shards": summary.num_shards}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc peak-RSS reset")
def test_peak_memory_is_bounded_by_tensor_and_shard_not_model(random_llama, tiny_llama_dir, tmp_path):
    result = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(random_llama), str(tiny_llama_dir),
                             str(tmp_path / "out")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout)
    growth = probe["peak"] - probe["base"]
    largest = max(info.nbytes for info in SourceCheckpoint(random_llama).tensors.values())
    # One output shard, a dozen float32 temporaries of the largest tensor, and allocator/thread slack.
    budget = 2_000_000 + 12 * largest + 24 * 2**20
    assert probe["source_bytes"] > 3 * budget  # the model is several times what the process may grow by
    assert growth < budget, f"peak RSS grew by {growth / 2**20:.1f} MiB; budget {budget / 2**20:.1f} MiB"


@pytest.mark.parametrize("signum,word", [(signal.SIGINT, "Interrupted"), (signal.SIGTERM, "Terminated")],
                         ids=["ctrl-c", "sigterm"])
def test_a_signal_explains_the_resume_releases_the_lock_and_leaves_a_resumable_partial(random_llama, tmp_path,
                                                                                        signum, word):
    out = tmp_path / "out"
    partial = tmp_path / ".out.qp-partial"
    proc = subprocess.Popen([*SLOW_CLI, "convert", str(random_llama), "-o", str(out), "--method", "rtn",
                             "--max-shard-size", "1MB", "--no-progress", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None and not (partial / "progress.json").exists():
        time.sleep(0.01)
    assert proc.poll() is None, "conversion finished before it could be interrupted"
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=60)
    message = f"{word}: finished shards are kept; re-run the same command to resume."
    assert proc.returncode == 128 + signum, stderr
    assert stderr.strip().splitlines() == [message]
    assert json.loads(stdout) == {"error": message, "exit_code": 128 + signum}
    assert not (tmp_path / ".out.qp-lock").exists()
    assert not out.exists() and json.loads((partial / "progress.json").read_text())["shards"]


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, str(os.getpid()).encode())
print("locked", flush=True)
time.sleep(120)
"""


def test_a_second_conversion_into_one_output_is_refused_until_the_first_ends(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    lock = tmp_path / ".out.qp-lock"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(lock)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert_usage_failure(run_cli(tiny_llama_dir, "-o", out, "--method", "rtn"),
                             f"another conversion (pid {holder.pid}) is writing {out}", out=out)
    finally:
        holder.kill()
        holder.wait()
    # The holder died without cleaning up: its lock file stays, but the lock went with the process.
    assert lock.exists()
    result = run_cli(tiny_llama_dir, "-o", out, "--method", "rtn", "--no-progress")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_restart_with_other_settings_says_it_discards_the_earlier_work(tiny_llama_dir, tmp_path,
                                                                         convert_interrupted):
    out = tmp_path / "out"
    convert_interrupted(tiny_llama_dir, out, max_shard_size="150KB", method="rtn", progress=False, at=3)
    result = run_cli(tiny_llama_dir, "-o", out, "--max-shard-size", "150KB", "--method", "rtn", "--bits", "8",
                     "--no-progress")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if "discarding" in line]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("warning: discarding the earlier partial conversion in ")
    assert "(2 finished shard(s)), made with other settings: bits 4 -> 8" in lines[0]
    assert "discarding" not in result.stdout
    # The same settings resume silently.
    convert_interrupted(tiny_llama_dir, tmp_path / "again", max_shard_size="150KB", method="rtn", progress=False, at=3)
    result = run_cli(tiny_llama_dir, "-o", tmp_path / "again", "--max-shard-size", "150KB", "--method", "rtn",
                     "--no-progress")
    assert result.exit_code == 0 and "discarding" not in result.stderr, result.output
