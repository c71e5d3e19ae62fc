"""Models by name: hub ids through a Hugging Face cache laid out as huggingface_hub lays it out (no network here),
and resolve_model's cache of exported files for -m."""
import os
import shutil

import pytest

from conftest import run_cli
from kuiper_py import hub
from kuiper_py.errors import KuiperError
from kuiper_py.export import export
from kuiper_py.loader import load

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_cache(tmp_path, monkeypatch, tiny_dir):
    """HF_HUB_CACHE holding Qwen/Tiny-AWQ at COMMIT (refs/main -> snapshots/COMMIT/<files>), offline."""
    import huggingface_hub.constants as c
    root = tmp_path / "hf"
    repo = root / "models--Qwen--Tiny-AWQ"
    (repo / "refs").mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(tiny_dir, repo / "snapshots" / COMMIT)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(root))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("KUIPER_CACHE", str(tmp_path / "kc"))
    return root


def _quiet(m):
    pass


def test_is_hub_id(tmp_path):
    assert hub.is_hub_id("Qwen/Qwen3-8B-AWQ") and hub.is_hub_id("Qwen/Qwen3-8B-AWQ@main")
    for bad in ("qwen3.bin", "Qwen", "a/b/c", "/abs/path", "Qwen/x.bin", "../x", "-x/y"):
        assert not hub.is_hub_id(bad), bad
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "m").mkdir()
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert not hub.is_hub_id("org/m")  # an existing directory is a path, not a hub id
    finally:
        os.chdir(cwd)


def test_export_by_hub_id_from_the_local_cache(hf_cache, tiny_bin, tmp_path):
    out = tmp_path / "m.bin"
    export("Qwen/Tiny-AWQ", out, progress=False, log=_quiet)
    assert out.read_bytes() == tiny_bin.read_bytes()
    export(f"Qwen/Tiny-AWQ@{COMMIT}", tmp_path / "r.bin", progress=False, log=_quiet)
    assert (tmp_path / "r.bin").read_bytes() == tiny_bin.read_bytes()


@pytest.mark.parametrize("arg", ["Qwen/Not-There", "Qwen/Tiny-AWQ@ffffffffffffffffffffffffffffffffffffffff"])
def test_unknown_hub_id_is_one_line_and_nothing_written(hf_cache, tmp_path, arg):
    with pytest.raises(KuiperError, match="is not in the Hugging Face cache and cannot be downloaded") as e:
        export(arg, tmp_path / "m.bin", progress=False, log=_quiet)
    assert "\n" not in str(e.value) and arg in str(e.value)
    assert not any(p.name.endswith(".bin") or ".partial" in p.name for p in tmp_path.iterdir())


def test_not_a_directory_nor_a_hub_id(tmp_path):
    with pytest.raises(KuiperError, match="not a directory or a Hugging Face hub id"):
        export(str(tmp_path / "nope"), tmp_path / "m.bin", progress=False, log=_quiet)


def test_resolve_model_file_directory_and_hub_id(hf_cache, tiny_dir, tiny_bin, tmp_path, monkeypatch):
    assert hub.resolve_model(str(tiny_bin)) == tiny_bin  # a file as is
    logs = []
    a = hub.resolve_model(str(tiny_dir), progress=False, log=logs.append)
    assert a.parent == tmp_path / "kc" / "dirs" and a.read_bytes() == tiny_bin.read_bytes()
    assert any("exporting" in m for m in logs)
    b = hub.resolve_model("Qwen/Tiny-AWQ", progress=False, log=logs.append)
    assert b == tmp_path / "kc" / "hub" / "Qwen--Tiny-AWQ" / f"{COMMIT}.bin"
    assert load(b).verify_checksum() is True

    def no_export(*a, **k):
        raise AssertionError("exported again")
    monkeypatch.setattr("kuiper_py.export.export", no_export)
    assert hub.resolve_model(str(tiny_dir), log=_quiet) == a  # reused: no second export
    assert hub.resolve_model("Qwen/Tiny-AWQ", log=_quiet) == b
    monkeypatch.undo()


def test_directory_key_follows_its_files(hf_cache, tiny_dir, copy_ckpt):
    d = copy_ckpt(tiny_dir)
    a = hub.resolve_model(str(d), progress=False, log=_quiet)
    cfg = d / "config.json"
    os.utime(cfg, ns=(cfg.stat().st_atime_ns, cfg.stat().st_mtime_ns + 10**9))  # the checkpoint changed
    b = hub.resolve_model(str(d), progress=False, log=_quiet)
    assert a != b and a.is_file() and b.is_file()


def test_resolve_model_refuses_junk_and_an_unwritable_cache(hf_cache, tiny_dir, tmp_path, monkeypatch):
    with pytest.raises(KuiperError, match="no such model file, Hugging Face directory or hub id"):
        hub.resolve_model(str(tmp_path / "missing.bin"))
    (tmp_path / "ro").write_text("a file where the cache directory should be")
    monkeypatch.setenv("KUIPER_CACHE", str(tmp_path / "ro"))
    with pytest.raises(KuiperError, match="cannot create the kuiper cache .*KUIPER_CACHE"):
        hub.resolve_model(str(tiny_dir), progress=False, log=_quiet)


def test_exported_hub_model_serves_when_the_hub_cache_is_gone(hf_cache, tmp_path):
    b = hub.resolve_model("Qwen/Tiny-AWQ", progress=False, log=_quiet)
    shutil.rmtree(hf_cache / "models--Qwen--Tiny-AWQ")
    logs = []
    assert hub.resolve_model("Qwen/Tiny-AWQ", log=logs.append) == b and "exported earlier" in logs[-1]
    with pytest.raises(KuiperError, match="cannot be downloaded"):
        hub.resolve_model("Qwen/Tiny-AWQ@ffffffffffffffffffffffffffffffffffffffff", log=_quiet)


def test_an_export_of_the_hubs_current_commit_is_used_without_a_download(hf_cache, monkeypatch):
    """Online, with the Hugging Face cache emptied after the export: the hub's commit for the id is asked (a small
    request) and the file exported from it used; the checkpoint is not downloaded again. A newer commit is."""
    import huggingface_hub
    from types import SimpleNamespace
    b = hub.resolve_model("Qwen/Tiny-AWQ", progress=False, log=_quiet)
    shutil.rmtree(hf_cache / "models--Qwen--Tiny-AWQ")
    downloads, head = [], {"sha": COMMIT}

    def fake_download(repo, revision=None, local_files_only=False, **kw):
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        downloads.append((repo, revision))
        raise OSError("network download (stubbed)")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    monkeypatch.setattr(huggingface_hub.HfApi, "model_info",
                        lambda self, repo, revision=None, **kw: SimpleNamespace(sha=head["sha"]))
    assert hub.resolve_model("Qwen/Tiny-AWQ", log=_quiet) == b and downloads == []
    head["sha"] = "f" * 40  # the hub moved on: that commit is fetched (here the stub fails, and the old file serves)
    assert hub.resolve_model("Qwen/Tiny-AWQ", log=_quiet) == b and downloads == [("Qwen/Tiny-AWQ", None)]


def test_commands_take_a_hub_id_for_m(hf_cache, tiny_bin):
    """`generate -m Qwen/Tiny-AWQ` exports once into KUIPER_CACHE, with the export said on stderr, then runs as the
    file would; a second run uses the cached file. `chat` and `bench` go the same way (Engine.load)."""
    env = {k: os.environ[k] for k in ("HF_HUB_CACHE", "HF_HUB_OFFLINE", "KUIPER_CACHE")}
    gen = ("generate", "--device", "cpu", "--temp", "0", "-n", 4, "-p", "Hello")
    want = run_cli(*gen, "-m", tiny_bin)
    assert want.returncode == 0, want.stderr
    first = run_cli(*gen, "-m", "Qwen/Tiny-AWQ", env=env)
    assert first.returncode == 0 and first.stdout == want.stdout, first.stderr
    assert "exporting" in first.stderr
    for arg in ("Qwen/Tiny-AWQ", f"Qwen/Tiny-AWQ@{COMMIT}"):  # (the same commit: the same file, no export)
        again = run_cli(*gen, "-m", arg, env=env)
        assert again.returncode == 0 and again.stdout == want.stdout and "exporting" not in again.stderr
    bad = run_cli(*gen, "-m", "Qwen/Not-There", env=env)
    errs = [ln for ln in bad.stderr.splitlines() if ln.startswith("kuiper: error")]
    assert bad.returncode == 2 and len(errs) == 1 and "Qwen/Not-There" in errs[0], bad.stderr


def test_serve_takes_a_hub_id_and_serves_it_under_that_name(hf_cache):
    import re
    import signal
    import subprocess
    import sys

    import httpx

    from conftest import child_env
    p = subprocess.Popen([sys.executable, "-m", "kuiper_py", "serve", "-m", "Qwen/Tiny-AWQ", "--device", "cpu",
                          "--port", "0", "--max-context", "64"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=child_env())
    try:
        lines = []
        while not any("ready on" in ln for ln in lines):
            lines.append(p.stderr.readline())
            assert lines[-1], "".join(lines)
        assert any("exporting Qwen/Tiny-AWQ" in ln for ln in lines)
        url = re.search(r"http://127\.0\.0\.1:\d+", lines[-1]).group(0)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["Qwen/Tiny-AWQ"]
        r = httpx.post(url + "/v1/completions", json={"model": "Qwen/Tiny-AWQ", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
