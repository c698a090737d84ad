"""Reading adapter directories: the digest follows the files' bytes; broken files are clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mlxkv_inference import MlxAutoregressiveBinding
from mlxkv_inference.adapters import AdapterStack, load_adapter
from mlxkv_inference.errors import AdapterLoadError
from tests.adapter_factories import write_random_adapter
from tests.factories import make_tiny_binding


@pytest.fixture(scope="module")
def tiny() -> MlxAutoregressiveBinding:
    return make_tiny_binding("llama", seed=0)


def test_the_digest_is_the_files_bytes_and_the_namespace_joins_digests(tiny: MlxAutoregressiveBinding,
                                                                       tmp_path: Path) -> None:
    first = write_random_adapter(tiny, tmp_path / "a", seed=1)
    shutil.copytree(first, tmp_path / "copy")
    second = write_random_adapter(tiny, tmp_path / "b", seed=2)
    a, copy, b = load_adapter(first), load_adapter(tmp_path / "copy"), load_adapter(second)
    assert a.digest == copy.digest != b.digest and len(a.digest) == 32
    assert (a.kind, a.scale, a.rank, len(a.layers)) == ("lora", 4.0, 4, 14)
    assert AdapterStack((a, b)).ns == f"{a.digest}+{b.digest}" and AdapterStack().ns == ""


def test_a_corrupt_safetensors_file_is_a_clear_error(tiny: MlxAutoregressiveBinding, tmp_path: Path) -> None:
    directory = write_random_adapter(tiny, tmp_path / "a")
    weights = directory / "adapters.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(AdapterLoadError, match=r"adapters\.safetensors is not a readable safetensors file"):
        load_adapter(directory)


@pytest.mark.parametrize(("config", "message"), [
    ("{not json", r"adapter_config\.json is not JSON"),
    (json.dumps({"fine_tune_type": "full", "lora_parameters": {"scale": 1}}), r"fine_tune_type 'full' is not"),
    (json.dumps({"lora_parameters": {"rank": 4}}), r"lora_parameters\.scale is None, not a number"),
])
def test_a_bad_config_is_a_clear_error(config: str, message: str, tiny: MlxAutoregressiveBinding, tmp_path: Path) -> None:
    directory = write_random_adapter(tiny, tmp_path / "a")
    (directory / "adapter_config.json").write_text(config)
    with pytest.raises(AdapterLoadError, match=message):
        load_adapter(directory)


def test_a_missing_directory_and_a_stacked_dora_are_refused(tiny: MlxAutoregressiveBinding, tmp_path: Path) -> None:
    with pytest.raises(AdapterLoadError, match=r"cannot read adapter file .*nowhere/adapter_config\.json"):
        load_adapter(tmp_path / "nowhere")
    lora = load_adapter(write_random_adapter(tiny, tmp_path / "lora"))
    dora = load_adapter(write_random_adapter(tiny, tmp_path / "dora", kind="dora"))
    with pytest.raises(ValueError, match="a DoRA adapter cannot be stacked"):
        AdapterStack((lora, dora))
    with pytest.raises(ValueError, match="an adapter is stacked twice"):
        AdapterStack((lora, lora))
