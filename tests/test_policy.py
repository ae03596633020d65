"""SkipCheck / Fallback: ORTModule's names and values, parsing, and what each flag means."""

from __future__ import annotations

import pickle

import pytest

from ort_autopatch.errors import ConfigError, OrtAutopatchError
from ort_autopatch.policy import (
    DEFAULT_FALLBACK,
    DEFAULT_SKIP_CHECK,
    Fallback,
    SkipCheck,
    falls_back,
    names,
    parse_fallback,
    parse_skip_check,
    skips,
)

# Copied from onnxruntime ortmodule/options.py (_SkipCheck) and _fallback.py (_FallbackPolicy).
ORTMODULE_SKIP_CHECK = {
    "SKIP_CHECK_DISABLED": 1,
    "SKIP_CHECK_DEVICE": 2,
    "SKIP_CHECK_BUILD_GRADIENT": 4,
    "SKIP_CHECK_EXECUTION_AGENT": 8,
}
ORTMODULE_FALLBACK = {
    "FALLBACK_DISABLE": 1,
    "FALLBACK_FORCE_TORCH_FORWARD": 2,
    "FALLBACK_FORCE_TORCH_BACKWARD": 4,
    "FALLBACK_UNSUPPORTED_DEVICE": 8,
    "FALLBACK_UNSUPPORTED_DATA": 16,
    "FALLBACK_UNSUPPORTED_TORCH_MODEL": 32,
    "FALLBACK_UNSUPPORTED_ONNX_MODEL": 64,
    "FALLBACK_BAD_INITIALIZATION": 128,
}


def test_skip_check_has_ortmodule_names_and_values() -> None:
    assert {m.name: m.value for m in SkipCheck} == ORTMODULE_SKIP_CHECK


def test_fallback_has_ortmodule_names_and_values() -> None:
    assert {m.name: m.value for m in Fallback} == ORTMODULE_FALLBACK


@pytest.mark.parametrize("name", list(ORTMODULE_SKIP_CHECK))
def test_parse_skip_check_accepts_every_name(name: str) -> None:
    assert parse_skip_check(name, "V") is SkipCheck[name]


@pytest.mark.parametrize("name", list(ORTMODULE_FALLBACK))
def test_parse_fallback_accepts_every_name(name: str) -> None:
    assert parse_fallback(name, "V") is Fallback[name]


def test_parse_joins_names_with_bars_and_tolerates_whitespace() -> None:
    value = " SKIP_CHECK_DEVICE |SKIP_CHECK_BUILD_GRADIENT|  SKIP_CHECK_EXECUTION_AGENT "
    assert parse_skip_check(value, "V") == (
        SkipCheck.SKIP_CHECK_DEVICE
        | SkipCheck.SKIP_CHECK_BUILD_GRADIENT
        | SkipCheck.SKIP_CHECK_EXECUTION_AGENT
    )


def test_parse_accepts_the_prefixed_form_ortmodule_users_write() -> None:
    assert parse_skip_check("_SkipCheck.SKIP_CHECK_DEVICE", "V") is SkipCheck.SKIP_CHECK_DEVICE
    assert parse_fallback(
        "_FallbackPolicy.FALLBACK_DISABLE|_FallbackPolicy.FALLBACK_UNSUPPORTED_DATA", "V"
    ) == (Fallback.FALLBACK_DISABLE | Fallback.FALLBACK_UNSUPPORTED_DATA)


def test_parse_ignores_case_of_names() -> None:
    assert (
        parse_fallback("fallback_unsupported_device", "V") is Fallback.FALLBACK_UNSUPPORTED_DEVICE
    )


def test_unknown_name_error_names_variable_value_and_accepted_names() -> None:
    with pytest.raises(ConfigError) as info:
        parse_fallback("FALLBACK_BOGUS", "ORT_AUTOPATCH_FALLBACK_POLICY")
    assert str(info.value) == (
        "ORT_AUTOPATCH_FALLBACK_POLICY='FALLBACK_BOGUS' is not valid: unknown policy name "
        "'FALLBACK_BOGUS'. Accepted: " + ", ".join(ORTMODULE_FALLBACK) + " (join several with '|')"
    )
    assert info.value.variable == "ORT_AUTOPATCH_FALLBACK_POLICY"
    assert info.value.value == "FALLBACK_BOGUS"


def test_unknown_skip_check_name_lists_skip_check_names() -> None:
    with pytest.raises(ConfigError) as info:
        parse_skip_check("SKIP_CHECK_DEVICE|SKIP_NOTHING", "ORTMODULE_SKIPCHECK_POLICY")
    message = str(info.value)
    assert message.startswith("ORTMODULE_SKIPCHECK_POLICY='SKIP_CHECK_DEVICE|SKIP_NOTHING'")
    assert "unknown policy name 'SKIP_NOTHING'" in message
    assert all(name in message for name in ORTMODULE_SKIP_CHECK)


def test_a_name_from_the_other_flag_type_is_rejected() -> None:
    with pytest.raises(ConfigError, match="unknown policy name 'FALLBACK_DISABLE'"):
        parse_skip_check("FALLBACK_DISABLE", "V")


def test_empty_value_is_rejected() -> None:
    with pytest.raises(ConfigError, match="no policy name given"):
        parse_fallback("  ", "V")


def test_empty_name_between_bars_is_rejected() -> None:
    with pytest.raises(ConfigError, match="empty policy name"):
        parse_fallback("FALLBACK_DISABLE||FALLBACK_UNSUPPORTED_DATA", "V")


def test_default_skip_check_skips_nothing() -> None:
    assert DEFAULT_SKIP_CHECK is SkipCheck.SKIP_CHECK_DISABLED
    assert not any(skips(DEFAULT_SKIP_CHECK, flag) for flag in SkipCheck)


def test_default_fallback_covers_unsupported_cases_and_bad_initialization() -> None:
    assert names(DEFAULT_FALLBACK) == [
        "FALLBACK_UNSUPPORTED_DEVICE",
        "FALLBACK_UNSUPPORTED_DATA",
        "FALLBACK_UNSUPPORTED_TORCH_MODEL",
        "FALLBACK_UNSUPPORTED_ONNX_MODEL",
        "FALLBACK_BAD_INITIALIZATION",
    ]


def test_skips_reports_only_the_flags_set() -> None:
    policy = SkipCheck.SKIP_CHECK_DEVICE | SkipCheck.SKIP_CHECK_BUILD_GRADIENT
    assert skips(policy, SkipCheck.SKIP_CHECK_DEVICE)
    assert not skips(policy, SkipCheck.SKIP_CHECK_EXECUTION_AGENT)


def test_skip_check_disabled_overrides_other_flags() -> None:
    policy = SkipCheck.SKIP_CHECK_DISABLED | SkipCheck.SKIP_CHECK_DEVICE
    assert not skips(policy, SkipCheck.SKIP_CHECK_DEVICE)


def test_falls_back_reports_only_the_flags_set() -> None:
    assert falls_back(DEFAULT_FALLBACK, Fallback.FALLBACK_UNSUPPORTED_DATA)
    assert not falls_back(DEFAULT_FALLBACK, Fallback.FALLBACK_FORCE_TORCH_FORWARD)


def test_fallback_disable_means_never_fall_back() -> None:
    policy = DEFAULT_FALLBACK | Fallback.FALLBACK_DISABLE
    assert not any(falls_back(policy, flag) for flag in Fallback)


def test_names_is_the_inverse_of_parsing() -> None:
    policy = Fallback.FALLBACK_FORCE_TORCH_BACKWARD | Fallback.FALLBACK_UNSUPPORTED_DEVICE
    assert parse_fallback("|".join(names(policy)), "V") == policy


def test_config_error_is_a_value_error_and_an_ort_autopatch_error() -> None:
    error = ConfigError("V", "x", "bad", "good")
    assert isinstance(error, ValueError)
    assert isinstance(error, OrtAutopatchError)


def test_config_error_survives_pickling() -> None:
    error = ConfigError("ORT_AUTOPATCH_OPSET", "99", "out of range", "14..20")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.variable, copy.value, copy.reason, copy.accepted, str(copy)) == (
        error.variable,
        error.value,
        error.reason,
        error.accepted,
        str(error),
    )
