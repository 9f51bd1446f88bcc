"""quantpack.checkpoint.hub against a pre-filled Hugging Face cache, offline (the ``hub_cache`` fixture)."""
import fnmatch

import huggingface_hub
import pytest

from quantpack.checkpoint import CheckpointError
from quantpack.checkpoint.hub import resolve_source


@pytest.mark.parametrize("revision", [None, "main", "commit"])
def test_offline_cache_hit_at_any_revision(hub_cache, monkeypatch, revision):
    """Default, branch and explicit commit all resolve from the cache under HF_HUB_OFFLINE, asking
    huggingface_hub for local files only (some 1.x releases otherwise listed the repo tree online
    for an explicit commit, and failed offline)."""
    calls = []
    real = huggingface_hub.snapshot_download

    def recording(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    rev = hub_cache.commit if revision == "commit" else revision
    resolved = resolve_source(hub_cache.repo_id, revision=rev)
    assert resolved.path.name == hub_cache.commit and (resolved.path / "config.json").is_file()
    assert [c["local_files_only"] for c in calls] == [True, True]  # the small files, then the shards they name


def test_offline_cache_miss_is_one_line(hub_cache):
    with pytest.raises(CheckpointError) as info:
        resolve_source("nobody/not-cached")
    assert str(info.value) == ("source: nobody/not-cached (revision main) is not in the Hugging Face cache and "
                               "HF_HUB_OFFLINE is set; download it once online or unset HF_HUB_OFFLINE")


@pytest.mark.parametrize("typo", ["./modle", "models/llama-typo", "ABS/models/llama"])
def test_a_mistyped_local_path_is_no_such_directory_not_a_hub_lookup(tmp_path, monkeypatch, typo):
    (tmp_path / "models" / "llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)

    def no_hub(*args, **kwargs):
        raise AssertionError("asked the Hub for a local path")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_hub)
    source = typo.replace("ABS", str(tmp_path)).replace("models/llama", "models/llama-typo")
    with pytest.raises(CheckpointError, match=rf"^source: no such directory: {source}"):
        resolve_source(source)


@pytest.mark.parametrize("trust_remote_code", [False, True])
def test_only_what_will_be_read_is_fetched(hub_cache, monkeypatch, trust_remote_code):
    """The index's shards and the small files, never a consolidated.safetensors beside them; the checkpoint's
    code only with trust_remote_code."""
    patterns = []
    real = huggingface_hub.snapshot_download

    def recording(*args, **kwargs):
        patterns.extend(kwargs["allow_patterns"])
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", recording)
    resolved = resolve_source(hub_cache.repo_id, trust_remote_code=trust_remote_code)

    def fetched(name):
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    shards = sorted(p.name for p in resolved.path.glob("model-*.safetensors"))
    assert shards and all(map(fetched, [*shards, "model.safetensors.index.json", "config.json", "tokenizer.json"]))
    assert not fetched("consolidated.safetensors") and not fetched("pytorch_model.bin")
    assert fetched("modeling_custom.py") is trust_remote_code
