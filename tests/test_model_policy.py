"""`ModelPolicy`, the router's options in one value: a bad one is refused with the value named."""

from __future__ import annotations

import pytest

from mlxkv.engine.models import ModelPolicy


@pytest.mark.parametrize(("policy", "message"), [
    ({"max_models": 0}, "--max-models=0 must be >= 1"),
    ({"max_models": 1, "pinned": ("a", "b")}, "2 pinned models do not fit in --max-models=1"),
    ({"max_models": 2, "ttl_s": -1.0}, "--model-ttl=-1.0 must be >= 0 seconds (0: never)"),
    ({"max_models": 2, "wait_s": float("nan")}, "wait_s=nan must be >= 0 seconds"),
])
def test_a_bad_policy_is_refused_naming_the_value(policy: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as refused:
        ModelPolicy(**policy)  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_pinned_and_default_models_must_be_registered() -> None:
    policy = ModelPolicy(2, pinned=("a",), default="c")
    policy.check_names(["a", "c"])
    with pytest.raises(ValueError) as refused:
        policy.check_names(["a", "b"])
    assert str(refused.value) == "model 'c' is not registered (registered: a, b)"
