"""load_config: every field from every source, precedence, and what each bad value says."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import textwrap

import pytest

from ort_autopatch.cli import build_parser
from ort_autopatch.config import (
    ENV_CONFIG_FILE,
    ENV_VARS,
    OPTIONS,
    Config,
    ConfigError,
    cli_values,
    load_config,
    markdown_table,
)
from ort_autopatch.policy import DEFAULT_FALLBACK, DEFAULT_SKIP_CHECK, Fallback, SkipCheck


@pytest.fixture
def empty_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    """A working directory without pyproject.toml, so only the given sources count."""
    folder = tmp_path / "empty"
    folder.mkdir()
    return folder


def env(empty_dir: pathlib.Path, **variables: str) -> Config:
    return load_config(environ=variables, cwd=empty_dir)


def write_pyproject(folder: pathlib.Path, body: str) -> pathlib.Path:
    path = folder / "pyproject.toml"
    path.write_text(textwrap.dedent(body), encoding="utf-8")
    return path


def assert_names(error: ConfigError, variable: str, value: object, *accepted: str) -> None:
    """The message names the source, quotes the value and says what is accepted."""
    message = str(error)
    assert error.variable == variable
    assert error.value == value
    assert message.startswith(f"{variable}={value!r} is not valid: ")
    assert "Accepted: " in message
    for word in accepted:
        assert word in error.accepted


# --- defaults -----------------------------------------------------------------------------------


def test_defaults_apply_when_nothing_is_set(empty_dir: pathlib.Path) -> None:
    config = env(empty_dir)
    assert config == Config()
    assert config.enabled is True
    assert config.modules == ()
    assert config.exclude == ()
    assert config.skip_check is DEFAULT_SKIP_CHECK
    assert config.fallback == DEFAULT_FALLBACK
    assert config.report is None
    assert config.log_level == "WARNING"
    assert config.cache_dir is None
    assert config.save_onnx is None
    assert config.opset == 17
    assert config.threads is None
    assert config.cache_size == 8


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        Config().opset = 18  # type: ignore[misc]


def test_empty_environment_variable_counts_as_unset(empty_dir: pathlib.Path) -> None:
    assert env(empty_dir, **{var: "" for var in ENV_VARS.values()}) == Config()


# --- enabled ------------------------------------------------------------------------------------


@pytest.mark.parametrize("word", ["1", "true", "YES", "On"])
def test_enabled_accepts_true_words(empty_dir: pathlib.Path, word: str) -> None:
    assert env(empty_dir, ORT_AUTOPATCH_ENABLED=word).enabled is True


@pytest.mark.parametrize("word", ["0", "False", "no", "OFF"])
def test_enabled_accepts_false_words(empty_dir: pathlib.Path, word: str) -> None:
    assert env(empty_dir, ORT_AUTOPATCH_ENABLED=word).enabled is False


def test_enabled_rejects_other_words(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError) as info:
        env(empty_dir, ORT_AUTOPATCH_ENABLED="maybe")
    assert_names(info.value, "ORT_AUTOPATCH_ENABLED", "maybe", "1/0", "true/false", "on/off")


def from_flags(empty_dir: pathlib.Path, *flags: str, **environ: str) -> Config:
    ns = build_parser().parse_args(list(flags))
    return load_config(cli=cli_values(ns), environ=environ, cwd=empty_dir)


def test_cli_disable_turns_the_tool_off(empty_dir: pathlib.Path) -> None:
    config = from_flags(empty_dir, "--disable", ORT_AUTOPATCH_ENABLED="1")
    assert config.enabled is False


def test_cli_without_disable_leaves_enabled_alone(empty_dir: pathlib.Path) -> None:
    assert from_flags(empty_dir, ORT_AUTOPATCH_ENABLED="0").enabled is False
    assert from_flags(empty_dir, ORT_AUTOPATCH_ENABLED="1").enabled is True


# --- modules / exclude --------------------------------------------------------------------------


def test_modules_is_a_comma_list_with_whitespace_tolerated(empty_dir: pathlib.Path) -> None:
    config = env(empty_dir, ORT_AUTOPATCH_MODULES=" mypkg.models:Net , __main__:*Head ")
    assert config.modules == ("mypkg.models:Net", "__main__:*Head")


def test_exclude_uses_the_same_syntax(empty_dir: pathlib.Path) -> None:
    assert env(empty_dir, ORT_AUTOPATCH_EXCLUDE="mypkg.*:Debug*").exclude == ("mypkg.*:Debug*",)


def test_modules_empty_entry_is_an_error(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="empty entry") as info:
        env(empty_dir, ORT_AUTOPATCH_MODULES="a:B,,c:D")
    assert_names(info.value, "ORT_AUTOPATCH_MODULES", "a:B,,c:D", "module.path:Class")


def test_modules_entry_without_class_is_an_error(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match=re.escape("'mypkg.models' has no ':Class'")) as info:
        env(empty_dir, ORT_AUTOPATCH_MODULES="mypkg.models")
    assert_names(info.value, "ORT_AUTOPATCH_MODULES", "mypkg.models", "module.path:Class")


def test_modules_entry_with_two_colons_is_an_error(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="more than one ':'") as info:
        env(empty_dir, ORT_AUTOPATCH_MODULES="a:B:C")
    assert_names(info.value, "ORT_AUTOPATCH_MODULES", "a:B:C", "module.path:Class")


def test_modules_entry_with_an_empty_side_is_an_error(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="empty side") as info:
        env(empty_dir, ORT_AUTOPATCH_EXCLUDE=":Net")
    assert_names(info.value, "ORT_AUTOPATCH_EXCLUDE", ":Net", "module.path:Class")


def test_modules_entry_with_inner_whitespace_is_an_error(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="whitespace"):
        env(empty_dir, ORT_AUTOPATCH_MODULES="my pkg:Net")


# --- policies -----------------------------------------------------------------------------------


def test_skip_check_policy_is_read_from_our_variable(empty_dir: pathlib.Path) -> None:
    config = env(
        empty_dir, ORT_AUTOPATCH_SKIPCHECK_POLICY="SKIP_CHECK_DEVICE|SKIP_CHECK_BUILD_GRADIENT"
    )
    assert config.skip_check == SkipCheck.SKIP_CHECK_DEVICE | SkipCheck.SKIP_CHECK_BUILD_GRADIENT


def test_skip_check_policy_falls_back_to_ortmodule_variable(empty_dir: pathlib.Path) -> None:
    config = env(empty_dir, ORTMODULE_SKIPCHECK_POLICY="SKIP_CHECK_EXECUTION_AGENT")
    assert config.skip_check is SkipCheck.SKIP_CHECK_EXECUTION_AGENT


def test_our_skip_check_variable_wins_over_ortmodules(empty_dir: pathlib.Path) -> None:
    config = env(
        empty_dir,
        ORT_AUTOPATCH_SKIPCHECK_POLICY="SKIP_CHECK_DEVICE",
        ORTMODULE_SKIPCHECK_POLICY="SKIP_CHECK_EXECUTION_AGENT",
    )
    assert config.skip_check is SkipCheck.SKIP_CHECK_DEVICE


def test_fallback_policy_is_read_from_our_variable(empty_dir: pathlib.Path) -> None:
    config = env(empty_dir, ORT_AUTOPATCH_FALLBACK_POLICY="FALLBACK_DISABLE")
    assert config.fallback is Fallback.FALLBACK_DISABLE


def test_fallback_policy_falls_back_to_ortmodule_variable(empty_dir: pathlib.Path) -> None:
    config = env(
        empty_dir, ORTMODULE_FALLBACK_POLICY="_FallbackPolicy.FALLBACK_FORCE_TORCH_FORWARD"
    )
    assert config.fallback is Fallback.FALLBACK_FORCE_TORCH_FORWARD


def test_our_fallback_variable_wins_over_ortmodules(empty_dir: pathlib.Path) -> None:
    config = env(
        empty_dir,
        ORT_AUTOPATCH_FALLBACK_POLICY="FALLBACK_UNSUPPORTED_DATA",
        ORTMODULE_FALLBACK_POLICY="FALLBACK_DISABLE",
    )
    assert config.fallback is Fallback.FALLBACK_UNSUPPORTED_DATA


def test_unknown_policy_name_error_names_our_variable(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError) as info:
        env(empty_dir, ORT_AUTOPATCH_FALLBACK_POLICY="FALLBACK_BOGUS")
    assert_names(
        info.value, "ORT_AUTOPATCH_FALLBACK_POLICY", "FALLBACK_BOGUS", "FALLBACK_DISABLE", "'|'"
    )


def test_unknown_policy_name_error_names_the_ortmodule_variable_it_came_from(
    empty_dir: pathlib.Path,
) -> None:
    with pytest.raises(ConfigError) as info:
        env(empty_dir, ORTMODULE_SKIPCHECK_POLICY="SKIP_EVERYTHING")
    assert_names(info.value, "ORTMODULE_SKIPCHECK_POLICY", "SKIP_EVERYTHING", "SKIP_CHECK_DEVICE")


# --- report, log level, paths -------------------------------------------------------------------


def test_report_dash_means_text_summary_on_stderr(empty_dir: pathlib.Path) -> None:
    assert env(empty_dir, ORT_AUTOPATCH_REPORT="-").report == "-"


def test_report_keeps_a_path_with_rank_placeholder(empty_dir: pathlib.Path) -> None:
    assert env(empty_dir, ORT_AUTOPATCH_REPORT="out/r{rank}.json").report == "out/r{rank}.json"


def test_log_level_is_case_insensitive_and_stored_upper(empty_dir: pathlib.Path) -> None:
    assert env(empty_dir, ORT_AUTOPATCH_LOG_LEVEL="debug").log_level == "DEBUG"


def test_bad_log_level_is_an_error(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError) as info:
        env(empty_dir, ORT_AUTOPATCH_LOG_LEVEL="VERBOSE")
    assert_names(info.value, "ORT_AUTOPATCH_LOG_LEVEL", "VERBOSE", "DEBUG, INFO, WARNING, ERROR")


def test_cache_dir_and_save_onnx_are_paths(empty_dir: pathlib.Path) -> None:
    config = env(empty_dir, ORT_AUTOPATCH_CACHE_DIR="/tmp/c", ORT_AUTOPATCH_SAVE_ONNX="onnx_out")
    assert config.cache_dir == pathlib.Path("/tmp/c")
    assert config.save_onnx == pathlib.Path("onnx_out")


# --- integers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("opset", ["14", "20"])
def test_opset_accepts_14_to_20(empty_dir: pathlib.Path, opset: str) -> None:
    assert env(empty_dir, ORT_AUTOPATCH_OPSET=opset).opset == int(opset)


@pytest.mark.parametrize("opset", ["13", "21"])
def test_opset_outside_14_to_20_is_an_error(empty_dir: pathlib.Path, opset: str) -> None:
    with pytest.raises(ConfigError, match="out of range") as info:
        env(empty_dir, ORT_AUTOPATCH_OPSET=opset)
    assert_names(info.value, "ORT_AUTOPATCH_OPSET", opset, "from 14 to 20")


def test_non_integer_opset_is_an_error(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="not an integer") as info:
        env(empty_dir, ORT_AUTOPATCH_OPSET="17.0")
    assert_names(info.value, "ORT_AUTOPATCH_OPSET", "17.0", "integer")


def test_threads_accepts_a_positive_integer(empty_dir: pathlib.Path) -> None:
    assert env(empty_dir, ORT_AUTOPATCH_THREADS="4").threads == 4


def test_zero_threads_is_an_error(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError) as info:
        env(empty_dir, ORT_AUTOPATCH_THREADS="0")
    assert_names(info.value, "ORT_AUTOPATCH_THREADS", "0", "positive integer")


def test_cache_size_accepts_a_positive_integer(empty_dir: pathlib.Path) -> None:
    assert env(empty_dir, ORT_AUTOPATCH_CACHE_SIZE="2").cache_size == 2


def test_bad_cache_size_is_an_error(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError) as info:
        env(empty_dir, ORT_AUTOPATCH_CACHE_SIZE="many")
    assert_names(info.value, "ORT_AUTOPATCH_CACHE_SIZE", "many", "positive integer")


# --- CLI ----------------------------------------------------------------------------------------


def test_cli_values_use_field_names(empty_dir: pathlib.Path) -> None:
    config = load_config(
        cli={
            "modules": "a:B",
            "exclude": ["a:C"],
            "skip_check": "SKIP_CHECK_DEVICE",
            "fallback": "FALLBACK_DISABLE",
            "report": "-",
            "log_level": "info",
            "cache_dir": pathlib.Path("/c"),
            "save_onnx": "/s",
            "opset": 18,
            "threads": "2",
            "cache_size": 3,
        },
        environ={},
        cwd=empty_dir,
    )
    assert config == Config(
        modules=("a:B",),
        exclude=("a:C",),
        skip_check=SkipCheck.SKIP_CHECK_DEVICE,
        fallback=Fallback.FALLBACK_DISABLE,
        report="-",
        log_level="INFO",
        cache_dir=pathlib.Path("/c"),
        save_onnx=pathlib.Path("/s"),
        opset=18,
        threads=2,
        cache_size=3,
    )


def test_cli_modules_may_be_a_sequence_of_comma_lists(empty_dir: pathlib.Path) -> None:
    config = load_config(cli={"modules": ["a:B,c:D", "e:F"]}, environ={}, cwd=empty_dir)
    assert config.modules == ("a:B", "c:D", "e:F")


def test_cli_none_means_flag_not_given(empty_dir: pathlib.Path) -> None:
    config = load_config(cli={"opset": None}, environ={"ORT_AUTOPATCH_OPSET": "15"}, cwd=empty_dir)
    assert config.opset == 15


def test_cli_error_names_the_flag(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(cli={"modules": "mypkg.models"}, environ={}, cwd=empty_dir)
    assert_names(info.value, "--modules", "mypkg.models", "module.path:Class")


def test_cli_policy_error_names_the_flag(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(cli={"skip_check": "SKIP"}, environ={}, cwd=empty_dir)
    assert_names(info.value, "--skip-check", "SKIP", "SKIP_CHECK_DISABLED")


def test_cli_wrong_type_is_an_error(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="expected an integer") as info:
        load_config(cli={"opset": True}, environ={}, cwd=empty_dir)
    assert_names(info.value, "--opset", True, "from 14 to 20")


def test_cli_unknown_key_is_a_programming_error(empty_dir: pathlib.Path) -> None:
    with pytest.raises(TypeError, match="script"):
        load_config(cli={"script": "train.py"}, environ={}, cwd=empty_dir)


# --- TOML file ----------------------------------------------------------------------------------


def test_pyproject_table_is_read(tmp_path: pathlib.Path) -> None:
    write_pyproject(
        tmp_path,
        """
        [tool.ort_autopatch]
        modules = ["a:B", "c:D"]
        exclude = "c:E"
        fallback = ["FALLBACK_UNSUPPORTED_DATA", "FALLBACK_BAD_INITIALIZATION"]
        enabled = false
        opset = 18
        log_level = "error"
        """,
    )
    config = load_config(environ={}, cwd=tmp_path)
    assert config.modules == ("a:B", "c:D")
    assert config.exclude == ("c:E",)
    assert config.fallback == (
        Fallback.FALLBACK_UNSUPPORTED_DATA | Fallback.FALLBACK_BAD_INITIALIZATION
    )
    assert config.enabled is False
    assert config.opset == 18
    assert config.log_level == "ERROR"


def test_pyproject_accepts_dashed_keys(tmp_path: pathlib.Path) -> None:
    write_pyproject(
        tmp_path, '[tool.ort_autopatch]\ncache-size = 4\nskip-check = "SKIP_CHECK_DEVICE"\n'
    )
    config = load_config(environ={}, cwd=tmp_path)
    assert (config.cache_size, config.skip_check) == (4, SkipCheck.SKIP_CHECK_DEVICE)


def test_pyproject_relative_paths_are_next_to_the_file(tmp_path: pathlib.Path) -> None:
    write_pyproject(tmp_path, '[tool.ort_autopatch]\ncache_dir = "cache"\nreport = "r.json"\n')
    config = load_config(environ={}, cwd=tmp_path)
    assert config.cache_dir == tmp_path / "cache"
    assert config.report == str(tmp_path / "r.json")


def test_pyproject_error_names_the_table_key(tmp_path: pathlib.Path) -> None:
    write_pyproject(tmp_path, '[tool.ort_autopatch]\nmodules = "mypkg.models"\n')
    with pytest.raises(ConfigError) as info:
        load_config(environ={}, cwd=tmp_path)
    assert_names(
        info.value, "pyproject.toml [tool.ort_autopatch] modules", "mypkg.models", "module.path"
    )


def test_pyproject_list_error_quotes_the_list_as_written(tmp_path: pathlib.Path) -> None:
    write_pyproject(tmp_path, '[tool.ort_autopatch]\nexclude = ["a:B", ""]\n')
    with pytest.raises(ConfigError, match="empty entry") as info:
        load_config(environ={}, cwd=tmp_path)
    assert_names(info.value, "pyproject.toml [tool.ort_autopatch] exclude", ["a:B", ""], "Class")


def test_pyproject_unknown_key_is_an_error(tmp_path: pathlib.Path) -> None:
    write_pyproject(tmp_path, '[tool.ort_autopatch]\nmodule = "a:B"\n')
    with pytest.raises(ConfigError, match="unknown key") as info:
        load_config(environ={}, cwd=tmp_path)
    assert_names(info.value, "pyproject.toml [tool.ort_autopatch] module", "a:B", "modules")


def test_pyproject_wrong_type_is_an_error(tmp_path: pathlib.Path) -> None:
    write_pyproject(tmp_path, '[tool.ort_autopatch]\nopset = "seventeen"\n')
    with pytest.raises(ConfigError, match="not an integer") as info:
        load_config(environ={}, cwd=tmp_path)
    assert_names(info.value, "pyproject.toml [tool.ort_autopatch] opset", "seventeen", "14")


def test_pyproject_without_our_table_is_ignored(tmp_path: pathlib.Path) -> None:
    write_pyproject(
        tmp_path, '[tool.ruff]\nline-length = 100\n[project]\nname = "ort_autopatch_x"\n'
    )
    assert load_config(environ={}, cwd=tmp_path) == Config()


def test_broken_pyproject_that_never_mentions_us_is_ignored(tmp_path: pathlib.Path) -> None:
    write_pyproject(tmp_path, "[tool.other\nbroken =")
    assert load_config(environ={}, cwd=tmp_path) == Config()


def test_broken_pyproject_with_our_table_is_an_error(tmp_path: pathlib.Path) -> None:
    path = write_pyproject(tmp_path, "[tool.ort_autopatch]\nmodules = [\n")
    with pytest.raises(ConfigError, match="cannot read it as TOML") as info:
        load_config(environ={}, cwd=tmp_path)
    assert_names(info.value, "pyproject.toml", str(path), "TOML")


def test_config_file_variable_replaces_pyproject(tmp_path: pathlib.Path) -> None:
    write_pyproject(tmp_path, "[tool.ort_autopatch]\nopset = 15\nthreads = 3\n")
    other = tmp_path / "ort.toml"
    other.write_text("opset = 16\n", encoding="utf-8")
    config = load_config(environ={"ORT_AUTOPATCH_CONFIG": "ort.toml"}, cwd=tmp_path)
    assert (config.opset, config.threads) == (16, None)


def test_config_file_may_hold_the_tool_table(tmp_path: pathlib.Path) -> None:
    other = tmp_path / "elsewhere.toml"
    other.write_text('[tool.ort_autopatch]\nmodules = "x:Y"\n', encoding="utf-8")
    config = load_config(environ={"ORT_AUTOPATCH_CONFIG": str(other)}, cwd=tmp_path)
    assert config.modules == ("x:Y",)


def test_missing_config_file_is_an_error(empty_dir: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="no such file") as info:
        env(empty_dir, ORT_AUTOPATCH_CONFIG="nope.toml")
    assert_names(info.value, "ORT_AUTOPATCH_CONFIG", "nope.toml", "TOML file")


def test_unparsable_config_file_is_an_error(tmp_path: pathlib.Path) -> None:
    (tmp_path / "bad.toml").write_text("opset = = 3\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="cannot read it as TOML") as info:
        load_config(environ={"ORT_AUTOPATCH_CONFIG": "bad.toml"}, cwd=tmp_path)
    assert_names(info.value, "ORT_AUTOPATCH_CONFIG", "bad.toml", "TOML")


def test_config_file_error_names_the_file_and_key(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "ort.toml"
    path.write_text("cache_size = 0\n", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(environ={"ORT_AUTOPATCH_CONFIG": str(path)}, cwd=tmp_path)
    assert_names(info.value, f"{path} cache_size", 0, "positive integer")


# --- precedence ---------------------------------------------------------------------------------


def test_toml_beats_defaults(tmp_path: pathlib.Path) -> None:
    write_pyproject(tmp_path, "[tool.ort_autopatch]\nopset = 15\n")
    assert load_config(environ={}, cwd=tmp_path).opset == 15


def test_environment_beats_toml(tmp_path: pathlib.Path) -> None:
    write_pyproject(tmp_path, "[tool.ort_autopatch]\nopset = 15\ncache_size = 2\n")
    config = load_config(environ={"ORT_AUTOPATCH_OPSET": "16"}, cwd=tmp_path)
    assert (config.opset, config.cache_size) == (16, 2)


def test_cli_beats_environment(tmp_path: pathlib.Path) -> None:
    write_pyproject(tmp_path, "[tool.ort_autopatch]\nopset = 15\ncache_size = 2\nthreads = 5\n")
    config = load_config(
        cli={"opset": 18},
        environ={"ORT_AUTOPATCH_OPSET": "16", "ORT_AUTOPATCH_CACHE_SIZE": "3"},
        cwd=tmp_path,
    )
    assert (config.opset, config.cache_size, config.threads) == (18, 3, 5)


def test_ortmodule_variable_beats_toml(tmp_path: pathlib.Path) -> None:
    write_pyproject(tmp_path, '[tool.ort_autopatch]\nfallback = "FALLBACK_UNSUPPORTED_DATA"\n')
    config = load_config(environ={"ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE"}, cwd=tmp_path)
    assert config.fallback is Fallback.FALLBACK_DISABLE


# --- to_env -------------------------------------------------------------------------------------


def test_to_env_round_trips_a_full_config(empty_dir: pathlib.Path) -> None:
    config = Config(
        enabled=False,
        modules=("a.*:B", "__main__:Net"),
        exclude=("a.x:*",),
        skip_check=SkipCheck.SKIP_CHECK_DEVICE | SkipCheck.SKIP_CHECK_EXECUTION_AGENT,
        fallback=Fallback.FALLBACK_DISABLE | Fallback.FALLBACK_UNSUPPORTED_DATA,
        report="r{rank}.json",
        log_level="DEBUG",
        backend="ort",
        cache_dir=pathlib.Path("/c"),
        save_onnx=pathlib.Path("out"),
        opset=19,
        threads=6,
        cache_size=1,
    )
    assert load_config(environ=config.to_env(), cwd=empty_dir) == config


def test_to_env_round_trips_the_default_config(empty_dir: pathlib.Path) -> None:
    assert load_config(environ=Config().to_env(), cwd=empty_dir) == Config()


def test_to_env_overrides_stale_inherited_values(empty_dir: pathlib.Path) -> None:
    inherited = {
        "ORT_AUTOPATCH_REPORT": "old.json",
        "ORT_AUTOPATCH_THREADS": "9",
        "ORTMODULE_FALLBACK_POLICY": "FALLBACK_DISABLE",
    }
    config = Config(modules=("a:B",))
    assert load_config(environ={**inherited, **config.to_env()}, cwd=empty_dir) == config


def test_to_env_sets_every_option_and_reads_no_file_in_the_child() -> None:
    assert set(Config().to_env()) == {*ENV_VARS.values(), ENV_CONFIG_FILE}
    assert Config().to_env()[ENV_CONFIG_FILE] == "none"


def test_to_env_wins_over_a_pyproject_where_the_child_starts(tmp_path: pathlib.Path) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.ort_autopatch]\nthreads = 3\nreport = "x"\n')
    config = Config(modules=("a:B",))
    assert load_config(environ=config.to_env(), cwd=tmp_path) == config


# --- the option table ---------------------------------------------------------------------------


def test_every_option_has_a_flag_in_the_launchers_help() -> None:
    help_text = build_parser().format_help()
    for opt in OPTIONS:
        assert opt.flag in help_text
        assert f"[{opt.env}]" in help_text


def test_every_flag_reaches_its_field(empty_dir: pathlib.Path) -> None:
    full = Config(
        enabled=False,
        modules=("a:B",),
        exclude=("a:C",),
        skip_check=SkipCheck.SKIP_CHECK_DEVICE,
        fallback=Fallback.FALLBACK_DISABLE,
        report="r.json",
        log_level="DEBUG",
        backend="ort-training",
        cache_dir=pathlib.Path("/c"),
        save_onnx=pathlib.Path("/s"),
        opset=15,
        threads=2,
        cache_size=3,
        untested_torch=True,
        torch_ops=("aten::einsum",),
        no_torch_ops=("aten::cumm*", "aten::lstm"),
        verify=2,
        static_after=0,
        compile_executor=False,
        memory_arena=False,
        max_graph_nodes=500,
        max_build_seconds=0,
        background_builds=False,
    )
    flags: list[str] = []
    for opt in OPTIONS:
        value = getattr(full, opt.name)
        if value == getattr(Config(), opt.name):
            raise AssertionError(f"give {opt.name} a non-default value in this test")
        if opt.flag_sets is value:
            flags.append(opt.flag)
        else:
            flags += [opt.flag, opt.kind.text(value)]
    assert from_flags(empty_dir, *flags) == full


def test_engine_options_are_what_the_engine_takes() -> None:
    from ort_autopatch.engine.recipe import EngineOptions

    values = Config().engine_values()
    assert set(values) == {f.name for f in dataclasses.fields(EngineOptions)}
    assert EngineOptions(**values) == EngineOptions()


def test_readme_option_table_matches_the_declarations() -> None:
    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text(encoding="utf-8")
    block = readme.split("<!-- options:begin -->\n")[1].split("\n<!-- options:end -->")[0]
    assert block == markdown_table(), "run: python tools/readme_options.py"


def test_operator_lists_take_names_with_or_without_the_aten_prefix(
    empty_dir: pathlib.Path,
) -> None:
    config = load_config(environ={"ORT_AUTOPATCH_TORCH_OPS": "einsum, aten::cummax"}, cwd=empty_dir)
    assert config.torch_ops == ("aten::einsum", "aten::cummax")


def test_an_operator_outside_aten_is_refused_with_what_is_accepted(
    empty_dir: pathlib.Path,
) -> None:
    with pytest.raises(ConfigError, match=r"ORT_AUTOPATCH_NO_TORCH_OPS.*not an ATen operator"):
        load_config(environ={"ORT_AUTOPATCH_NO_TORCH_OPS": "prim::PythonOp"}, cwd=empty_dir)


def test_the_backend_option_takes_its_names_in_any_case() -> None:
    assert load_config(environ={"ORT_AUTOPATCH_BACKEND": "ORT"}).backend == "ort"
    assert load_config(cli={"backend": "ort-training"}).backend == "ort-training"
    with pytest.raises(ConfigError, match="ORT_AUTOPATCH_BACKEND"):
        load_config(environ={"ORT_AUTOPATCH_BACKEND": "cuda"})
