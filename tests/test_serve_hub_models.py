"""Hugging Face ids (`--model org/name`, a request's `model`) resolve from the local hub cache, laid
out as huggingface_hub lays it out (and read back by its own `scan_cache_dir`); never the network."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import httpx
import pytest
from huggingface_hub import scan_cache_dir
from huggingface_hub.file_download import repo_folder_name

from mlxkv.engine.model_sources import hub_cached, parse_model_spec, resolve_source
from mlxkv.engine.models import ModelSpec
from mlxkv_inference.errors import ModelLoadError
from tests.factories import make_tiny_binding
from tests.factories import save_mlx_lm_directory
from tests.test_serve_models import answer, complete, serve_args, serving

REPO = "tiny-org/tiny-llama-4bit"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def add_to_hub_cache(cache: Path, repo_id: str, model_dir: Path) -> Path:
    """Put `model_dir`'s files into the hub cache `cache` as a download leaves them: content-addressed
    blobs, a snapshot of symlinks for the commit, refs/main naming it. Returns the snapshot."""
    repo = cache / repo_folder_name(repo_id=repo_id, repo_type="model")
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in sorted(model_dir.iterdir()):
        blob = repo / "blobs" / hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, blob)
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the hub cache holding REPO, the same model as a plain directory)."""
    root = tmp_path_factory.mktemp("hub")
    local = root / "tiny-llama"
    save_mlx_lm_directory(make_tiny_binding("llama", seed=3), local)
    add_to_hub_cache(root / "cache", REPO, local)
    return root / "cache", local


@pytest.fixture
def offline_hub(hub: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setenv("HF_HUB_CACHE", str(hub[0]))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


def test_the_test_cache_is_one_huggingface_hub_reads(hub: tuple[Path, Path]) -> None:
    info = scan_cache_dir(hub[0])
    assert [(r.repo_id, [rev.commit_hash for rev in r.revisions]) for r in info.repos] == [(REPO, [COMMIT])]
    assert info.warnings == []


def test_a_hub_id_resolves_to_its_snapshot_offline(offline_hub: tuple[Path, Path]) -> None:
    snapshot = resolve_source(REPO)
    assert snapshot == offline_hub[0] / f"models--tiny-org--tiny-llama-4bit/snapshots/{COMMIT}"
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(p.name for p in offline_hub[1].iterdir())
    assert hub_cached(REPO) and not hub_cached("tiny-org/not-there")
    assert parse_model_spec(REPO) == ModelSpec(REPO, REPO)  # named by its id, as mlx_lm.server clients send it


def test_an_id_missing_from_the_cache_offline_is_a_clear_error(offline_hub: tuple[Path, Path]) -> None:
    with pytest.raises(ModelLoadError, match=r"'tiny-org/not-there' is not in the Hugging Face cache \(.*\) and "
                                             "HF_HUB_OFFLINE is set"):
        resolve_source("tiny-org/not-there")


def test_serve_model_hub_id_answers_as_the_same_model_from_a_directory(offline_hub: tuple[Path, Path]) -> None:
    with serving(serve_args("--model", str(offline_hub[1]))) as (url, _):
        expected = answer(complete(url, "x"))[1]
    with serving(serve_args("--model", REPO)) as (url, engine):
        model, text, _ = answer(complete(url, "x"))
        listed = [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]]
    assert (model, text, listed, engine.model_id) == (REPO, expected, [REPO], REPO)


def test_a_request_naming_a_cached_hub_id_is_served_beside_the_registered_models(
    offline_hub: tuple[Path, Path], tmp_path: Path
) -> None:
    other = tmp_path / "tiny-qwen3"
    save_mlx_lm_directory(make_tiny_binding("qwen3", seed=5), other)
    with serving(serve_args("--model", f"local={offline_hub[1]}", "--model", f"other={other}")) as (url, _):
        local = answer(complete(url, "local"))
        hub_model = answer(complete(url, REPO))
        missing = complete(url, "tiny-org/not-there")
        listed = {m["id"]: m["state"] for m in httpx.get(url + "/v1/models").json()["data"]}
    assert hub_model[:2] == (REPO, local[1])
    assert missing.status_code == 404
    assert listed == {"local": "loaded", "other": "unloaded", REPO: "loaded"}
